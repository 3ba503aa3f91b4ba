"""Accumulator under DistributedDataParallel: 2 gloo processes on CPU, bounded by a timeout."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from autobatch.training._accumulator import Accumulator
from autobatch.training._window_agreement import WindowAgreement
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import leave_gloo_worker

WORLD_SIZE = 2
TIMEOUT_S = 120.0

# Per-sample gradients of the loss x * w are the samples x. One sample per micro-batch in window 0
# (rank 0: 1 and 3, rank 1: 2 and 5: mean 11 / 4 = 2.75); window 1 has unequal counts per rank
# (rank 0: 4, 6, 8; rank 1: 10, 1, 2, 3: mean 34 / 7).
SAMPLES = {
    0: [[1.0], [3.0], [4.0, 6.0], [8.0]],
    1: [[2.0], [5.0], [10.0], [1.0, 2.0, 3.0]],
}
WANT_GRADS = [11 / 4, 34 / 7]


class RecordedWindowAgreement(WindowAgreement):
    """The ranks' agreements besides DDP's gradient all-reduce, each recorded by its place."""

    __slots__ = ("places",)

    def __init__(self, group: dist.ProcessGroup, model: nn.Module) -> None:
        super().__init__(group, model)
        self.places: list[str] = []

    def meet(self, count: int, **kwargs: Any) -> tuple[int, bool]:
        self.places.append(kwargs["where"])
        return super().meet(count, **kwargs)


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = DistributedDataParallel(nn.Linear(1, 1, bias=False).double())
        with torch.no_grad():
            model.module.weight.fill_(1.0)
        num_allreduce = [0]

        # Unannotated: DDP checks the annotations, which `from __future__ import annotations`
        # turns into strings.
        def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
            num_allreduce[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        acc = Accumulator(model, opt, gradient_accumulation_steps=2, max_grad_norm=100.0)
        acc._agreement = agreement = RecordedWindowAgreement(model.process_group, model)
        batches = [torch.tensor(s, dtype=torch.float64).unsqueeze(1) for s in SAMPLES[rank]]
        results = []
        for window in acc.windows(batches):
            num_allreduce[0] = 0
            before = float(model.module.weight)
            for micro in window:
                with micro.sync_context():
                    micro.backward(model(micro.batch).mean())
            stats = window.step()
            results.append(
                {
                    "grad": before - float(model.module.weight),  # SGD, lr 1
                    "loss": float(stats.loss),
                    "want_loss": before * float(torch.cat(batches[2 * window.index :][:2]).mean()),
                    "grad_norm": float(stats.grad_norm) if stats.grad_norm is not None else None,
                    "num_allreduce": num_allreduce[0],
                    "global_count": stats.global_count,
                    "local_count": stats.local_count,
                }
            )
        results.append({"agreements": agreement.places})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_gloo_worker()


@pytest.mark.slow  # gloo ranks in spawned processes
def test_ddp_window_gradient_is_the_global_mean_with_one_allreduce(tmp_path: Path) -> None:
    # A file store needs no port, so parallel test runs cannot collide.
    spawn_and_wait(_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD_SIZE, TIMEOUT_S)

    for rank in range(WORLD_SIZE):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # One per window and one at the end: none before the synchronised backward, since no
        # micro-batch counts 0 items.
        assert results.pop()["agreements"] == [
            "the count agreement of window 0",
            "the count agreement of window 1",
            "the end of the micro-batches after 2 windows",
        ]
        assert [r["num_allreduce"] for r in results] == [1, 1]
        assert [r["global_count"] for r in results] == [4, 7]
        assert [r["local_count"] for r in results] == [[2, 3], [2, 4]][rank]
        for r, want in zip(results, WANT_GRADS, strict=True):
            assert r["grad"] == pytest.approx(want, abs=1e-12)
            assert r["grad_norm"] == pytest.approx(want, abs=1e-12)
            assert r["loss"] == pytest.approx(r["want_loss"], abs=1e-12)  # this rank's mean
