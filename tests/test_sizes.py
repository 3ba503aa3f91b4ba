"""Guard rails on size: small modules with one job each, short functions, short signatures.

Each allow-list names what is still over its limit: a new one fails, and a listed one that is
back within the limit must leave its list (so it cannot grow back unnoticed).

- A module is over when it has more than ``MAX_MODULE_LINES`` lines.
- A function is over when its body, from the first statement after its docstring to its last
  line, has more than ``MAX_FUNCTION_LINES`` lines. The signature and the docstring are left
  out: a long signature is the parameter limit's to catch, and a full docstring (Args, Returns,
  Raises) is wanted, not a cost.
- A function is over when it takes more than ``MAX_PARAMETERS`` parameters: positional,
  keyword-only, ``*args`` and ``**kwargs`` each count one; a method's ``self`` or ``cls`` does
  not.

The checks take the repository root, so the tests at the end plant each violation in a fake
tree and see it reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("autobatch", "service", "bench", "examples")

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 10

LONG_MODULES: set[str] = set()
"""Modules still over ``MAX_MODULE_LINES`` lines, by path."""

LONG_FUNCTIONS: set[str] = set()
"""Functions whose body is still over ``MAX_FUNCTION_LINES`` lines, by path and qualified
name."""

WIDE_FUNCTIONS: set[str] = {
    # autobatch.probe's public keywords (the DESIGN's probe contract): a flat keyword function
    # the house keeps as the public convenience until it builds its request from one declaration.
    "autobatch/probing/_prober.py:probe",
    "autobatch/probing/_estimator.py:estimate",
    # Accumulator(...): the training loop's constructor, called by users with keywords.
    "autobatch/training/_accumulator.py:Accumulator.__init__",
}
"""Functions still over ``MAX_PARAMETERS`` parameters, by path and qualified name."""


def modules(root: Path, folders: Iterable[str] = FOLDERS) -> Iterator[Path]:
    """Every Python module under ``root``'s ``folders``."""
    for folder in folders:
        yield from sorted((root / folder).rglob("*.py"))


def functions(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` by its qualified name (``Class.method``, a nested function
    under its parents)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from functions(child, f"{name}.")
        else:
            yield from functions(child, prefix)


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = function.body
    first = body[0]
    value = first.value if isinstance(first, ast.Expr) else None
    if isinstance(value, ast.Constant) and isinstance(value.value, str) and len(body) > 1:
        first = body[1]
    assert function.end_lineno is not None
    return function.end_lineno - first.lineno + 1


def num_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters ``function`` takes, ``*args`` and ``**kwargs`` one each, ``self`` and
    ``cls`` left out."""
    arguments = function.args
    positional = [a.arg for a in (*arguments.posonlyargs, *arguments.args)]
    if positional[:1] in (["self"], ["cls"]):
        positional = positional[1:]
    starred = (arguments.vararg is not None) + (arguments.kwarg is not None)
    return len(positional) + len(arguments.kwonlyargs) + starred


def _num_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def module_lines(root: Path, folders: Iterable[str] = FOLDERS) -> dict[str, int]:
    """Each module's line count, by its path from ``root``."""
    return {str(path.relative_to(root)): _num_lines(path) for path in modules(root, folders)}


def function_sizes(root: Path, folders: Iterable[str] = FOLDERS) -> dict[str, tuple[int, int]]:
    """Each function's (body lines, parameters), by ``path:qualified.name``."""
    return {
        f"{path.relative_to(root)}:{name}": (body_lines(function), num_parameters(function))
        for path in modules(root, folders)
        for name, function in functions(ast.parse(path.read_text()))
    }


def oversized(root: Path, folders: Iterable[str] = FOLDERS) -> dict[str, dict[str, int]]:
    """What is over each limit under ``root``: ``{"modules": {path: lines}, "functions":
    {name: body lines}, "parameters": {name: parameters}}``."""
    sizes = function_sizes(root, folders)
    return {
        "modules": {p: n for p, n in module_lines(root, folders).items() if n > MAX_MODULE_LINES},
        "functions": {f: n for f, (n, _) in sizes.items() if n > MAX_FUNCTION_LINES},
        "parameters": {f: n for f, (_, n) in sizes.items() if n > MAX_PARAMETERS},
    }


ALLOWED = {"modules": LONG_MODULES, "functions": LONG_FUNCTIONS, "parameters": WIDE_FUNCTIONS}
LIMITS = {
    "modules": f"split these by responsibility (at most {MAX_MODULE_LINES} lines)",
    "functions": f"split these (bodies of at most {MAX_FUNCTION_LINES} lines)",
    "parameters": f"pass a request or options object (at most {MAX_PARAMETERS} parameters)",
}


def unlisted(
    over: dict[str, dict[str, int]], allowed: dict[str, set[str]]
) -> dict[str, dict[str, int]]:
    """What is over a limit and not on its allow-list, by kind."""
    return {
        kind: {name: n for name, n in found.items() if name not in allowed[kind]}
        for kind, found in over.items()
        if any(name not in allowed[kind] for name in found)
    }


def stale(over: dict[str, dict[str, int]], allowed: dict[str, set[str]]) -> dict[str, list[str]]:
    """Allow-list entries no longer over their limit (or gone), by kind."""
    return {
        kind: sorted(allowed[kind] - set(over[kind]))
        for kind in allowed
        if allowed[kind] - set(over[kind])
    }


def test_nothing_new_is_over_a_limit() -> None:
    new = unlisted(oversized(ROOT), ALLOWED)
    assert not new, {LIMITS[kind]: names for kind, names in new.items()}


def test_the_allow_lists_hold_only_what_is_still_over() -> None:
    # Back within the limit (or gone): drop the entry, so the item cannot grow back unnoticed.
    fixed = stale(oversized(ROOT), ALLOWED)
    assert not fixed, f"within the limit now: remove from the allow-lists: {fixed}"


def test_the_folders_cover_the_library_the_service_bench_and_examples() -> None:
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))} - {
        "tests"
    } <= set(FOLDERS)


# The guards on planted violations.


def test_body_lines_leave_the_docstring_out() -> None:
    (function,) = ast.parse('def f():\n    """Doc.\n\n    More."""\n    x = 1\n    return x\n').body
    assert isinstance(function, ast.FunctionDef)
    assert body_lines(function) == 2


def test_body_lines_leave_a_long_signature_out() -> None:
    source = "def f(\n" + "".join(f"    a{i},\n" for i in range(10)) + "):\n    return 1\n"
    (function,) = ast.parse(source).body
    assert isinstance(function, ast.FunctionDef)
    assert body_lines(function) == 1


def test_parameters_count_every_kind_but_self_and_cls() -> None:
    source = (
        "class C:\n"
        "    def m(self, a, /, b, *args, c, d=1, **kwargs): ...\n"
        "    @classmethod\n"
        "    def k(cls, a): ...\n"
        "def f(selfish, a): ...\n"
    )
    sizes = {name: num_parameters(function) for name, function in functions(ast.parse(source))}
    assert sizes == {"C.m": 6, "C.k": 1, "f": 2}


def _plant(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_size_guards_report_each_planted_violation(tmp_path: Path) -> None:
    wide = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS + 1))
    fitting = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS))
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES + 1))
    root = _plant(
        tmp_path,
        {
            "autobatch/planning/_big.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
            "autobatch/planning/_fits.py": "x = 1\n" * MAX_MODULE_LINES,
            "service/routes.py": f"class Route:\n    def get(self, {wide}):\n        return 1\n",
            "service/ok.py": f"class Route:\n    def get(self, {fitting}):\n        pass\n",
            "bench/load.py": f"def main():\n    '''Doc.'''\n{long_body}",
            "bench/short.py": "def main():\n" + long_body.replace("    x0 = 0\n", ""),
            "examples/train.py": f"def outer():\n    def step({wide}):\n        pass\n",
        },
    )
    assert oversized(root) == {
        "modules": {"autobatch/planning/_big.py": MAX_MODULE_LINES + 1},
        "functions": {"bench/load.py:main": MAX_FUNCTION_LINES + 1},
        "parameters": {
            "examples/train.py:outer.step": MAX_PARAMETERS + 1,
            "service/routes.py:Route.get": MAX_PARAMETERS + 1,
        },
    }


def test_an_allowed_entry_back_within_its_limit_is_reported(tmp_path: Path) -> None:
    wide = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS + 1))
    root = _plant(
        tmp_path,
        {
            "autobatch/tuning/_tune.py": f"def tune({wide}): ...\ndef autotune(p0): ...\n",
            "bench/plan_call.py": f"def main({wide}): ...\n",
        },
    )
    allowed = {
        "modules": {"autobatch/tuning/_tune.py"},
        "functions": set(),
        "parameters": {"autobatch/tuning/_tune.py:tune", "autobatch/tuning/_tune.py:autotune"},
    }
    over = oversized(root)
    assert unlisted(over, allowed) == {
        "parameters": {"bench/plan_call.py:main": MAX_PARAMETERS + 1}
    }
    assert stale(over, allowed) == {
        "modules": ["autobatch/tuning/_tune.py"],
        "parameters": ["autobatch/tuning/_tune.py:autotune"],
    }
