"""``autobatch tune --activation-checkpointing`` and ``--report``: the flag reaches the library,
the notes say which modes ran and why, and the report renders in a real browser (headless
Chromium) with the chosen point in it."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from autobatch.cli import main
from tests.cli.test_cli import run

BROWSER_VARIABLE = "AUTOBATCH_TEST_BROWSER"
"""``required``: the browser test fails instead of skipping when Chromium is absent (CI)."""


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One ``tune --activation-checkpointing auto --report`` (its stdout, the report's path)."""
    report = tmp_path_factory.mktemp("report") / "report.html"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(
            [
                *["tune", "gpt2-tiny", "--seq-len", "32", "--device", "sim:48MiB", "--no-store"],
                *["--effective-batch-size", "2", "--activation-checkpointing", "auto"],
                *["--report", str(report)],
            ]
        )
    assert code == 0, err.getvalue()
    return out.getvalue(), report


def test_auto_says_which_modes_it_tried_and_why(auto_run: tuple[str, Path]) -> None:
    out, _ = auto_run
    assert "gradient_accumulation_steps  1" in out
    assert "activation_checkpointing " not in out  # none chosen: the model as given
    assert (
        "note: activation checkpointing modes tried none; skipped selective, full: the plan "
        "without checkpointing reaches the effective batch in one micro-step (micro-batch 2)"
    ) in out


def test_the_report_is_self_contained(auto_run: tuple[str, Path]) -> None:
    page = auto_run[1].read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    assert page.count('id="chosen-point"') == 1
    assert 'data-mode="none" data-micro-batch-size="2"' in page
    assert 'id="budget-line"' in page


def test_the_report_speaks_in_words_with_ticks_and_a_labelled_choice(
    auto_run: tuple[str, Path],
) -> None:
    page = auto_run[1].read_text()
    text = re.sub(r"<[^>]*>", " ", page)  # what a reader sees: no tags, no attributes
    for spelling in ("micro_batch_size", "peak_memory_bytes", "_bytes", " x "):
        assert spelling not in text, spelling
    assert "<h1>autobatch: activation checkpointing none, micro-batch 2 \u00d7 1 step</h1>" in page
    assert "peak memory (budget 48.00 MiB)" in text
    assert ">chosen: none, micro-batch 2 \u00d7 1 step</text>" in page  # the ring's label
    memory_ticks = re.findall(r'class="tick y">.*?font-size="10">([^<]*)</text>', page)
    assert memory_ticks[:4] == ["0 B", "20 MiB", "40 MiB", "0 s"]  # then the seconds chart
    assert re.findall(r'class="tick x">.*?font-size="10">([^<]*)</text>', page)[:3] == [
        "0", "1", "2",
    ]  # fmt: skip
    assert "<th>peak memory</th>" in page and "MiB</td>" in page


def test_the_report_renders_in_a_headless_browser(auto_run: tuple[str, Path]) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get(BROWSER_VARIABLE) == "required":
            pytest.fail(f"{BROWSER_VARIABLE}=required but chromium is not installed")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"]
        + [auto_run[1].as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    # The DOM the browser built (parsed, SVG in place), not the file's text.
    assert "<svg" in dom
    assert 'id="chosen-point"' in dom
    assert 'class="trial fits"' in dom
    assert 'id="chosen-label"' in dom and 'class="tick y"' in dom


def test_an_unknown_mode_is_refused_by_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys,
        *["tune", "gpt2-tiny", "--effective-batch-size", "2"],
        *["--activation-checkpointing", "most"],
    )
    assert code == 2
    assert "--activation-checkpointing: invalid choice: 'most'" in err
