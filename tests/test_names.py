"""One name per concept: the retired names appear nowhere in autobatch/ and service/, the alias
``data_parallel_size`` only at the edges that accept it, and each range has one check.

The walk reads every module's syntax tree: identifiers (names, attributes, definitions,
arguments, keywords, imports) and string constants (a pydantic field or a dict key is a
string too), so a name cannot hide in a keyword or a table.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("autobatch", "service")

RETIRED = ("data_parallel_ranks", "group_size", "put_job", "get_job")
"""Names that had a second name for a concept: the data-parallel size (``world_size``) and the
store's probe runs (``put_probe_run``/``get_probe_run``)."""

ALIAS_EDGES = {
    "autobatch/conditions.py",  # one_world_size, the one reconciliation; RENAMED_KEYS
    "autobatch/tuning/_request.py",  # autotune's keyword (TuneOptions) mapped to world_size
    "service/plans/schemas.py",  # POST /v1/plan's field
}
"""The modules where ``data_parallel_size`` may appear: the accepted alias of ``world_size``.
The CLI's flag is spelled ``--data-parallel-size`` (autobatch/cli/_parser.py), not a Python
name."""

RANGE_CHECKS = {
    "safety_margin": (r"^safety_margin \{\} must be", "autobatch/margin.py:check_safety_margin"),
    "search cap": (
        r"^max_micro_batch_size \{\} must be an int",
        "autobatch/probing/_options.py:check_search_arguments",
    ),
    "gpu_fraction": (
        r"^gpu_fraction \{\} must be",
        "autobatch/device/_budget.py:check_gpu_fraction",
    ),
    "world_size": (r"^world_size \{\} must be", "autobatch/conditions.py:check_world_size"),
}
"""Each range: the message its refusal starts with (placeholders as ``{}``), and the one
function that raises it."""


def _modules(root: Path = ROOT) -> Iterator[tuple[str, ast.Module]]:
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            yield path.relative_to(root).as_posix(), ast.parse(path.read_text())


def words(tree: ast.AST) -> Iterator[str]:
    """Every identifier and string constant in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg is not None:
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.asname or node.name.rsplit(".", 1)[-1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def where_named(name: str, root: Path = ROOT) -> set[str]:
    """The modules under autobatch/ and service/ where ``name`` is an identifier or a string."""
    return {path for path, tree in _modules(root) if name in set(words(tree))}


def _message(node: ast.expr) -> str:
    """An f-string's or string's text, each placeholder as ``{}``; "" for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) else "{}" for part in node.values
        )
    return ""


def raisers(pattern: str, root: Path = ROOT) -> set[str]:
    """``path:function`` of every function that raises an error whose first argument's text
    matches ``pattern``."""
    found = set()
    for path, tree in _modules(root):
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Raise)
                    and isinstance(node.exc, ast.Call)
                    and node.exc.args
                    and re.search(pattern, _message(node.exc.args[0]))
                ):
                    found.add(f"{path}:{function.name}")
    return found


@pytest.mark.parametrize("name", RETIRED)
def test_a_retired_name_appears_nowhere(name: str) -> None:
    assert where_named(name) == set()


def test_the_alias_data_parallel_size_appears_only_at_its_edges() -> None:
    assert where_named("data_parallel_size") == ALIAS_EDGES


@pytest.mark.parametrize("concept", sorted(RANGE_CHECKS))
def test_each_range_is_checked_by_one_function(concept: str) -> None:
    pattern, checker = RANGE_CHECKS[concept]
    assert raisers(pattern) == {checker}


def test_the_walk_sees_a_planted_name_and_a_second_check(tmp_path: Path) -> None:
    planted = tmp_path / "autobatch" / "planted.py"
    planted.parent.mkdir()
    (tmp_path / "service").mkdir()
    planted.write_text(
        "def f(options):\n"
        "    options.put_job(group_size=1)\n"
        "    return {'data_parallel_ranks': 2}\n"
        "\n"
        "def g(value):\n"
        "    raise ValueError(f'world_size {value!r} must be an int >= 1')\n"
    )
    for name in ("put_job", "group_size", "data_parallel_ranks"):
        assert where_named(name, tmp_path) == {"autobatch/planted.py"}
    assert raisers(RANGE_CHECKS["world_size"][0], tmp_path) == {"autobatch/planted.py:g"}


def test_the_cli_and_the_library_default_to_one_search_cap() -> None:
    from autobatch.cli._parser import build_parser
    from autobatch.probing import DEFAULT_SEARCH_LIMIT

    args = build_parser().parse_args(["tune", "gpt2-tiny", "--effective-batch-size", "8"])
    assert args.max_micro_batch_size == DEFAULT_SEARCH_LIMIT == 65536
