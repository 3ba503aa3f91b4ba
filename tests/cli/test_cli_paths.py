"""Paths and settings the user names that cannot be used: one line naming them and the fix, never
a traceback (issue 46's fresh-user findings: ``plan --output`` into a missing folder,
``serve --log-level loud``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import run


def test_an_output_into_a_missing_folder_is_one_line_naming_the_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "missing" / "plan.env"
    code, out, err = run(
        capsys, "plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64",
        "--output", str(target),
    )  # fmt: skip
    assert (code, out) == (1, "")
    assert err == (
        f"autobatch plan: error: {target}: No such file or directory; check that the path and its "
        "folder exist and are writable\n"
    )  # the user's path, not the temporary file beside it


def test_a_log_level_uvicorn_does_not_have_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "serve", "--log-level", "loud")
    assert (code, out) == (2, "")
    assert "--log-level" in err and "'debug'" in err and "(got 'loud')" in err
    assert "Traceback" not in err and "KeyError" not in err
