"""The Lightning and Hugging Face Trainer examples run end to end on the CPU with a simulated
card, in a subprocess as a user would run them (their frameworks' warnings stay out of this
session's ``filterwarnings = error``)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str) -> str:
    done = subprocess.run(
        [sys.executable, f"examples/{script}", "--effective-batch-size", "64", "--steps", "2"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "sizes"),
    [
        ("lightning_autobatch.py", r"micro-batch (\d+) x accumulate_grad_batches (\d+)"),
        (
            "hf_trainer_autobatch.py",
            r"per_device_train_batch_size (\d+) x gradient_accumulation_steps (\d+)",
        ),
    ],
)
def test_example_plans_an_exact_batch_and_trains_at_it(script: str, sizes: str) -> None:
    out = run_example(script)
    plan = re.search(sizes + r" x world size 1 = (\d+) \(largest that fits: (\d+), measured\)", out)
    assert plan is not None, out
    micro_batch_size, steps, total, largest = map(int, plan.groups())
    assert micro_batch_size * steps == total == 64
    assert steps > 1 and micro_batch_size <= largest < 64  # the 24 MiB card forces accumulation
    trained = re.search(r"trained (\d+) optimizer steps; (?:last )?loss ([\d.]+)", out)
    assert trained is not None, out
    assert int(trained[1]) == 2
    # Random weights over a 1000-token vocabulary: cross-entropy near ln(1000) = 6.91.
    assert abs(float(trained[2]) - math.log(1000)) < 0.5
