"""The examples keep their profiles apart from the user's store: each example that stores
profiles defaults ``--store`` to its own path (the README's snippet names its own store:
tests/test_docs.py runs it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from autobatch.store._location import default_store_path

ROOT = Path(__file__).resolve().parents[1]
STORING = sorted(p for p in (ROOT / "examples").glob("*.py") if "--store" in p.read_text())


def store_default(path: Path) -> str:
    """The example's ``--store`` default, evaluated from its own ``EXAMPLE_STORE`` line."""
    tree = ast.parse(path.read_text())
    (assign,) = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "EXAMPLE_STORE" for t in node.targets)
    ]
    import os
    import tempfile

    value = eval(
        compile(ast.Expression(assign.value), str(path), "eval"), {"os": os, "tempfile": tempfile}
    )
    assert isinstance(value, str)
    return value


def test_the_examples_that_store_profiles_are_found() -> None:
    names = {p.name for p in STORING}
    assert {"train_gpt2.py", "torchrun_autotune.py", "train_variable_length.py"} <= names


@pytest.mark.parametrize("path", STORING, ids=lambda p: p.name)
def test_each_example_defaults_to_its_own_store(path: Path) -> None:
    text = path.read_text()
    assert re.search(r'"--store",\s*default=EXAMPLE_STORE', text), path.name
    assert Path(store_default(path)) != default_store_path()
    assert "autobatch-examples" in store_default(path)
