"""The framework drop-ins' shared arithmetic: how many samples an epoch's last optimizer step
sees when the dataset's rows do not fill whole steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autobatch.integrations.dropins import last_step_samples
from autobatch.planning.planner import plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("num_rows", "limit", "effective", "world_size", "drop_last", "expected"),
    [
        (96, 16, 48, 1, False, 48),  # two whole steps of 3 x 16
        (64, 16, 48, 1, False, 16),  # 4 micro-batches: the second step has one
        (70, 16, 48, 1, False, 22),  # 4 of 16 and a partial 6: the second step has 16 + 6
        (70, 16, 48, 1, True, 16),  # the partial micro-batch dropped
        (100, 10, 40, 2, False, 10),  # 50 rows a rank: 5 micro-batches of 10, k = 2
        (8, 16, 48, 1, True, 0),  # not one whole micro-batch
    ],
)
def test_last_step_samples(
    num_rows: int, limit: int, effective: int, world_size: int, drop_last: bool, expected: int
) -> None:
    p = plan(limit, effective_batch_size=effective, world_size=world_size, uneven="never")
    assert last_step_samples(num_rows, p, drop_last=drop_last) == expected
    # Cross-check by simulating the epoch: rows per rank split into micro-batches, windows of k.
    rows = -(-num_rows // world_size)
    sizes = [p.micro_batch_size] * (rows // p.micro_batch_size)
    if not drop_last and rows % p.micro_batch_size:
        sizes.append(rows % p.micro_batch_size)
    k = p.gradient_accumulation_steps
    windows = [sum(sizes[i : i + k]) for i in range(0, len(sizes), k)]
    assert (windows[-1] if windows else 0) == expected


def test_the_integrations_package_imports_no_torch_and_no_framework() -> None:
    # Each framework's drop-in lives in its own submodule; the package itself only has configs.
    code = (
        "import sys, autobatch.integrations as i; i.hf_training_arguments;"
        "print(sorted(m for m in ('torch', 'lightning', 'transformers', 'accelerate')"
        " if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.split() == ["[]"]
