"""``MixedBatchSampler``'s short last global batch under DDP on 2 gloo ranks: the ranks train it
at its real size (fewer micro-steps, smaller micro-batches, every row once), and the
Accumulator's step is the float64 gradient of exactly those rows (computed in one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

SIZES = [3, 1]  # rank 0 trains 3 rows per micro-step, rank 1 one
STEPS = 2  # global batch: (3 + 1) x 2 = 8 rows
NUM_ROWS = 13  # one global batch of 8, then a short one of 5: [2, 1] and [1, 1]
LR = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _data() -> torch.Tensor:
    return torch.randn(NUM_ROWS, 4, generator=torch.Generator().manual_seed(7)).double()


def _worker(rank: int, tmp: str) -> None:
    from autobatch.training import Accumulator, MixedBatchSampler

    join_gloo_group(rank, len(SIZES), f"{tmp}/rendezvous", timeout_s=60)
    model = nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = MixedBatchSampler(
        NUM_ROWS, rank_micro_batch_sizes=SIZES, gradient_accumulation_steps=STEPS, seed=1
    )
    shares = list(sampler)
    data = _data()
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=STEPS)
    windows, after = [], []
    for window in acc.windows(data[rows] for rows in shares):
        stats = window.run(lambda batch: (model(batch) ** 2).mean())
        windows.append([stats.local_count, stats.global_count, stats.num_micro_steps])
        after.append([p.detach().tolist() for p in model.parameters()])
    result = {"shares": shares, "windows": windows, "after": after}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


@pytest.mark.slow  # gloo ranks in spawned processes
def test_a_short_last_global_batch_steps_on_the_exact_gradient_of_its_rows(
    tmp_path: Path,
) -> None:
    spawn_and_wait(_worker, (str(tmp_path),), len(SIZES), timeout_s=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(SIZES))]
    assert [[len(m) for m in r["shares"]] for r in ranks] == [[3, 3, 2, 1], [1, 1, 1, 1]]
    assert [r["windows"] for r in ranks] == [[[6, 8, 2], [3, 5, 2]], [[2, 8, 2], [2, 5, 2]]]
    batches = [
        sorted(row for r in ranks for m in r["shares"][w * STEPS : (w + 1) * STEPS] for row in m)
        for w in range(2)
    ]
    assert [len(rows) for rows in batches] == [8, 5]
    assert sorted(batches[0] + batches[1]) == list(range(NUM_ROWS))  # each row once
    model, data = _model(), _data()
    for window, rows in enumerate(batches):
        model.zero_grad()
        (model(data[rows]) ** 2).mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad  # type: ignore[operator]
        for result in ranks:
            for got, want in zip(result["after"][window], model.parameters(), strict=True):
                error = float((torch.tensor(got, dtype=torch.float64) - want.detach()).abs().max())
                assert error <= 1e-12, (window, error)
