"""Guard rails on size: small modules with one job each, short functions.

Each allow-list names what is still over its limit: a new one fails, and a listed one that is
back within the limit must leave its list (so it cannot grow back unnoticed). A module is over
when it has more than ``MAX_MODULE_LINES`` lines; a function when its body, from the first
statement after its docstring to its last line, has more than ``MAX_FUNCTION_LINES``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("autobatch", "service")

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

LONG_MODULES: set[str] = set()
"""Modules still over ``MAX_MODULE_LINES`` lines, by path."""

LONG_FUNCTIONS: set[str] = set()
"""Functions whose body is still over ``MAX_FUNCTION_LINES`` lines, by path and qualified
name."""


def _modules() -> Iterator[Path]:
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _functions(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` by its qualified name (``Class.method``, a nested function
    under its parents)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, f"{name}.")
        else:
            yield from _functions(child, prefix)


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = function.body
    first = body[0]
    value = first.value if isinstance(first, ast.Expr) else None
    if isinstance(value, ast.Constant) and isinstance(value.value, str) and len(body) > 1:
        first = body[1]
    assert function.end_lineno is not None
    return function.end_lineno - first.lineno + 1


def _num_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_new_module_is_over_the_line_limit() -> None:
    over = {
        str(path.relative_to(ROOT)): _num_lines(path)
        for path in _modules()
        if _num_lines(path) > MAX_MODULE_LINES
    }
    new = {path: n for path, n in over.items() if path not in LONG_MODULES}
    assert not new, f"split these by responsibility (at most {MAX_MODULE_LINES} lines): {new}"


def test_no_new_function_is_over_the_line_limit() -> None:
    over = {
        f"{path.relative_to(ROOT)}:{name}": _body_lines(function)
        for path in _modules()
        for name, function in _functions(ast.parse(path.read_text()))
        if _body_lines(function) > MAX_FUNCTION_LINES
    }
    new = {name: n for name, n in over.items() if name not in LONG_FUNCTIONS}
    assert not new, f"split these (bodies of at most {MAX_FUNCTION_LINES} lines): {new}"


def test_the_allow_lists_hold_only_what_is_still_over() -> None:
    # Shrunk under the limit: drop the entry, so the item cannot grow back unnoticed.
    modules = {str(path.relative_to(ROOT)): _num_lines(path) for path in _modules()}
    fixed_modules = {path for path in LONG_MODULES if modules.get(path, 0) <= MAX_MODULE_LINES}
    functions = {
        f"{path.relative_to(ROOT)}:{name}": _body_lines(function)
        for path in _modules()
        for name, function in _functions(ast.parse(path.read_text()))
    }
    fixed_functions = {
        name for name in LONG_FUNCTIONS if functions.get(name, 0) <= MAX_FUNCTION_LINES
    }
    assert not fixed_modules, f"now within the limit: remove from LONG_MODULES: {fixed_modules}"
    assert not fixed_functions, (
        f"now within the limit: remove from LONG_FUNCTIONS: {fixed_functions}"
    )


def test_body_lines_leave_the_docstring_out() -> None:
    (function,) = ast.parse('def f():\n    """Doc.\n\n    More."""\n    x = 1\n    return x\n').body
    assert isinstance(function, ast.FunctionDef)
    assert _body_lines(function) == 2
