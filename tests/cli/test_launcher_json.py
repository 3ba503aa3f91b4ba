"""``autobatch launcher --json`` prints the whole layout, outside a launcher too (one process,
rank 0 of 1), with the keys it prints inside one (issue 46: not ``null``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli.test_cli import run


def test_outside_a_launcher_json_is_the_one_process_layout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "environ", {"PATH": "/usr/bin"})
    code, out, _ = run(capsys, "launcher", "--json")
    assert code == 0
    assert json.loads(out) == {
        "world_size": 1,
        "nodes": 1,
        "ranks_per_node": 1,
        "rank": 0,
        "local_rank": 0,
        "source": "one process (no launcher's variables)",
    }
    assert run(capsys, "launcher")[1] == "1 rank: one process (no launcher's variables)\n"
    monkeypatch.setattr(
        os,
        "environ",
        {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
    )
    code, inside, _ = run(capsys, "launcher", "--json")
    assert code == 0
    assert json.loads(inside).keys() == json.loads(out).keys()
    assert json.loads(inside)["world_size"] == 2
