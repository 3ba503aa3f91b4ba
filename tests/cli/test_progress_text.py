"""``tune``'s progress line: the stage, the trials and the most left, from a sequence of probe
events (no timing asserted); a warning during the probe is written on a line of its own, in
flags; the real probe sends the stages in order."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from autobatch.cli import build_parser, main
from autobatch.cli._progress import ProbeDisplay, Progress
from autobatch.cli._wording import warning_words
from autobatch.errors import Remedy, ReportWarning
from autobatch.probing import ProbeStage
from autobatch.profile import Trial


def fits(size: int, peak_bytes: int) -> Trial:
    return Trial(micro_batch_size=size, fits=True, peak_reserved_bytes=peak_bytes)


def test_the_line_shows_the_stage_the_trials_and_the_most_left() -> None:
    display = ProbeDisplay()
    seen = [display.text()]
    events: list[ProbeStage | Trial] = [
        ProbeStage(stage="warm-up", max_trials=14),
        fits(1, 2**20),
        ProbeStage(stage="estimate", max_trials=14, trials_run=1),
        ProbeStage(stage="trials", max_trials=14, trials_run=1),
        fits(400, 256 * 2**20),
        Trial(micro_batch_size=401, fits=False, oom=True),
        ProbeStage(stage="confirm", max_trials=14, trials_run=3),
    ]
    for event in events:
        if isinstance(event, ProbeStage):
            display.stage(event)
        else:
            display.trial(event)
        seen.append(display.text())
    assert seen == [
        "probing, starting: 0 trials",
        "probing, warm-up (micro-batch 1: creates the optimizer state): 0 trials; at most 14 left",
        "probing, warm-up (micro-batch 1: creates the optimizer state): 1 trial (micro-batch 1 "
        "fits, peak 1.00 MiB); at most 13 left",
        "probing, estimate (fake tensors: CPU time, no real step): 1 trial (micro-batch 1 fits, "
        "peak 1.00 MiB); at most 13 left",
        "probing, trials: 1 trial (micro-batch 1 fits, peak 1.00 MiB); at most 13 left",
        "probing, trials: 2 trials (micro-batch 400 fits, peak 256.00 MiB); at most 12 left",
        "probing, trials: 3 trials (micro-batch 401 OOM); at most 11 left",
        "probing, confirm (the chosen size's second step): 3 trials (micro-batch 401 OOM); at "
        "most 11 left",
    ]


def test_each_modes_probe_is_named_and_counts_its_own_trials_left() -> None:
    # --activation-checkpointing auto: one probe per mode, each with its own bound; the line
    # names the mode, and what is left is the running probe's (never "at most 0" then a trial).
    display = ProbeDisplay(name_modes=True)
    seen = []
    for mode in ("none", "full"):
        display.stage(ProbeStage(stage="warm-up", max_trials=3, checkpointing_mode=mode))
        display.trial(fits(1, 2**20))
        display.stage(
            ProbeStage(stage="trials", max_trials=3, trials_run=1, checkpointing_mode=mode)
        )
        display.trial(fits(2, 2**20))
        display.stage(
            ProbeStage(stage="timing", max_trials=3, trials_run=2, checkpointing_mode=mode)
        )
        display.trial(fits(2, 2**20))
        seen.append(display.text())
    assert seen == [
        "probing without checkpointing, timing (the plan's micro-batch, 3 trials): 3 trials "
        "(micro-batch 2 fits, peak 1.00 MiB); at most 0 left",
        "probing with full checkpointing, timing (the plan's micro-batch, 3 trials): 6 trials "
        "(micro-batch 2 fits, peak 1.00 MiB); at most 0 left",
    ]
    display.stage(ProbeStage(stage="warm-up", max_trials=3, checkpointing_mode="selective"))
    assert display.text().startswith("probing with selective checkpointing, warm-up")
    assert display.text().endswith("; at most 3 left")


def test_a_warning_is_a_line_of_its_own_in_flags(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(enabled=True, word=warning_words(build_parser(), "tune"))
    progress.stage(ProbeStage(stage="warm-up", max_trials=14))
    again = Remedy(parameter="refresh", values=(True,), purpose="probe again and send it")
    progress.warning(ReportWarning("could not register the profile", remedies=(again,)))
    progress.close()
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    warned = "autobatch: warning: could not register the profile; use --refresh (probe again"
    assert any(line.startswith(warned) for line in lines), lines


def test_tune_reports_its_stages_and_a_failed_report_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AUTOBATCH_NODE_NAME", "NODE_NAME", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    argv = ["--store", str(tmp_path / "s.sqlite3"), "tune", "tests.service.models:tiny_mlp"]
    argv += ["--input-shape", "32", "--device", "sim:4MiB", "--effective-batch-size", "64"]
    assert main([*argv, "--report-to", "http://127.0.0.1:9"]) == 0
    err = capsys.readouterr().err.replace("\r", "\n")
    stages = [s for s in ("warm-up", "trials", "confirm") if f"probing, {s}" in err]
    assert stages == ["warm-up", "trials", "confirm"]
    asked, warned = [line for line in err.splitlines() if line.startswith("autobatch: warning:")]
    # The logger's warning (the lookup) and the report's, each on a line of its own.
    assert asked.startswith("autobatch: warning: could not ask the autobatch service")
    assert "could not register the profile with the autobatch service" in warned
    assert warned.endswith("; use --refresh (probe again and send it)")
    assert "refresh=True" not in err and "autobatch.client" not in err


def test_the_progress_line_does_not_tick_into_a_log_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # stderr a log file (CI, kubectl logs): a line an event, no carriage return, no clock
    # ticking (were a ticker drawing, a 0 s tick would add redraws between the events).
    import autobatch.cli._progress as progress_module

    err = io.StringIO()  # not a terminal: isatty() is False
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress_module, "TICK_SECONDS", 0.0)
    progress = Progress(enabled=True)
    display = ProbeDisplay()
    events: list[ProbeStage | Trial] = [
        ProbeStage(stage="trials", max_trials=8),
        fits(4, 2**20),
        ProbeStage(stage="confirm", max_trials=8),
    ]
    expected = []
    for event in events:
        if isinstance(event, ProbeStage):
            progress.stage(event)
            display.stage(event)
        else:
            progress.trial(event)
            display.trial(event)
        expected.append(display.text())
    progress.warning("a warning")
    progress.close()
    assert "\r" not in err.getvalue()
    assert err.getvalue().splitlines() == [*expected, "autobatch: warning: a warning"]
