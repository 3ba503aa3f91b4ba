"""``autobatch tune --activation-checkpointing auto`` where several modes run: the probe time
counts every mode's trials (split per mode), each probe's progress names its mode and counts
what it has left, and where nothing fits the error names every mode tried and says --report
wrote no page."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from autobatch.cli._output import print_plan
from autobatch.cli._progress import ProbeDisplay
from autobatch.probing import ProbeStage
from autobatch.profile import Trial
from autobatch.tuning import TuneRequest, tune_request
from tests.cli.test_cli import run

transformers = pytest.importorskip("transformers")

TUNE = ["tune", "gpt2-tiny", "--seq-len", "32", "--no-store", "--effective-batch-size", "64"]


def test_the_probe_time_counts_every_mode() -> None:
    # The library road tune runs (no fake-tensor estimate: a few times faster on this tiny
    # step), drawn by tune's own progress display and printed as tune prints it.
    model, sample = _model()
    display = ProbeDisplay(name_modes=True)
    lines: list[str] = []

    def stage(event: ProbeStage) -> None:
        display.stage(event)
        lines.append(display.text())

    def trial(event: Trial) -> None:
        display.trial(event)
        lines.append(display.text())

    tuned = tune_request(
        TuneRequest.build(
            model, sample, effective_batch_size=9, device="sim:2MiB", use_store=False,
            use_estimate=False, activation_checkpointing="auto", on_stage=stage, on_trial=trial,
        )
    )  # fmt: skip
    assert tuned.checkpointing is not None
    assert tuned.checkpointing.tried == ("none", "selective", "full")
    out = io.StringIO()
    print_plan(tuned.plan, "text", out, profile=tuned.profile, checkpointing=tuned.checkpointing)
    line = next(line for line in out.getvalue().splitlines() if line.startswith("probe time"))
    found = re.fullmatch(
        r"probe time       ([\d.]+) s over 3 modes: none ([\d.]+) s \((\d+) trials\), "
        r"selective ([\d.]+) s \((\d+) trials\), full ([\d.]+) s \((\d+) trials\)",
        line,
    )
    assert found, line
    total, *parts = found.groups()
    assert float(total) == pytest.approx(sum(float(parts[i]) for i in (0, 2, 4)), rel=0.02)
    counted = [int(parts[i]) for i in (1, 3, 5)]
    assert counted == [run.num_trials for run in tuned.checkpointing.runs]
    plain, *others = tuned.checkpointing.runs
    assert plain.plan is not None
    for other in others:  # a plan no larger than the plain one is never chosen: left untimed
        if other.plan is not None and other.plan.micro_batch_size <= plain.plan.micro_batch_size:
            assert other.timing == (), other.mode
    assert sum(counted) == int(re.search(r": (\d+) trials", lines[-1])[1])  # every trial
    assert f"  {tuned.plan.activation_checkpointing}'s probe" in out.getvalue()
    # Each mode's probe is named on the line, and none says "at most 0 left" and then runs
    # one more trial.
    for mode in ("without checkpointing", "with selective checkpointing", "with full "):
        assert any(line.startswith(f"probing {mode}") for line in lines), mode
    for before, after in zip(lines, lines[1:], strict=False):
        if before.endswith("at most 0 left") and after.startswith(before.split(",")[0]):
            assert re.search(r": (\d+) trial", before)[1] == re.search(r": (\d+) trial", after)[1]


def _model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def test_where_nothing_fits_the_error_names_every_mode_and_the_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "r.html"
    code, _, err = run(
        capsys,
        *TUNE,
        *["--device", "sim:1MiB", "--activation-checkpointing", "auto", "--report", str(report)],
    )
    assert code != 0
    error = err.splitlines()[-1]
    assert "does not fit" in error
    assert "activation checkpointing 'auto' tried none, selective, full" in error
    assert "full: not even micro-batch 1 fits" in error
    assert f"--report {report}: no page was written, for no plan came back" in error
    assert not report.exists()
