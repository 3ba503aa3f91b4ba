"""The training example runs end to end on the CPU, in a subprocess as a user would run it (so
transformers' warnings stay out of this session's ``filterwarnings = error``)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_example(store: Path) -> str:
    done = subprocess.run(
        [sys.executable, "examples/train_gpt2.py", "--store", str(store), "--steps", "3"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "loss_type" not in done.stderr  # transformers' warning when no loss is named
    return done.stdout


@pytest.mark.slow
def test_train_gpt2_autotunes_then_accumulates_token_weighted_windows(tmp_path: Path) -> None:
    store = tmp_path / "profiles.sqlite"
    out = _run_example(store)

    plan = re.search(r"plan: micro-batch (\d+) x (\d+) accumulation steps = 32 .*, (\w+)\)", out)
    assert plan is not None, out
    micro_batch_size, steps = int(plan[1]), int(plan[2])
    assert steps > 1 and micro_batch_size * steps == 32  # the simulated 40 MiB card forces it
    assert plan[3] == "measured"
    rows = re.findall(r"step (\d+): loss ([\d.]+) over (\d+) tokens in (\d+) micro-batches", out)
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    for _, loss, tokens, micro_steps in rows:
        # Random weights over a 1000-token vocabulary: cross-entropy near ln(1000) = 6.91.
        assert abs(float(loss) - math.log(1000)) < 0.5
        # Padded sequences: fewer predicted tokens than 32 x 63.
        assert 0 < int(tokens) < 32 * 63 and int(micro_steps) == steps

    again = _run_example(store)  # the same model, step and card: answered from the store
    assert re.search(rf"plan: micro-batch {micro_batch_size} x {steps} .*, cached\)", again), again


@pytest.mark.slow
def test_variable_length_training_splits_rare_long_batches_and_never_crashes(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "examples/train_variable_length.py", "--store", str(tmp_path / "p.db")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "loss_type" not in done.stderr  # transformers' warning when no loss is named
    plan = re.search(
        r"plan: micro-batch (\d+) x (\d+) accumulation steps, probed at 32", done.stdout
    )
    assert plan is not None, done.stdout
    summary = re.search(
        r"done: 200 micro-steps, (\d+) with a 128-token sequence, (\d+) splits \(smallest "
        r"piece (\d+)\), 0 crashes",
        done.stdout,
    )
    assert summary is not None, done.stdout[-3000:]
    num_long, num_splits, smallest = (int(g) for g in summary.groups())
    # The simulated card runs out on the long batches (the plan never saw one), and the run
    # goes on at a smaller piece size.
    assert num_long > 0 and num_splits > 0
    assert 1 <= smallest < int(plan[1])
    assert "out of memory in forward at micro-batch size" in done.stderr
