"""The probe's fake collectives on a real NCCL group (`pytest -m gpu`; skipped without CUDA).

``autobatch.distributed._fake_backend.process_groups_faked`` swaps every process group's backend for
a
fake one while a probe's step runs and puts the real one back after; the CPU tests pin it on
gloo only. Here one rank on one GPU checks the same on NCCL: inside, a CUDA all-reduce goes to
the fake backend; after (the block raising included), the group's CUDA backend is NCCL's own
object again and communicates; a probe whose train_step all-reduces its loss leaves it so too.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autobatch.distributed._fake_backend import process_groups_faked
from autobatch.tuning import tune

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.fixture
def nccl_group(tmp_path: Path) -> Iterator[Any]:
    """A one-rank NCCL default group on cuda:0, destroyed after the test."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path}/rendezvous",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_nccl_backend_is_faked_inside_and_its_own_after(nccl_group: Any) -> None:
    real = nccl_group._get_backend(CUDA)
    assert type(real).__name__ == "ProcessGroupNCCL"
    for _ in range(2):  # the second time reuses the group's fake backend
        with pytest.raises(KeyError), process_groups_faked() as groups:
            assert groups >= 1
            assert nccl_group._get_backend(CUDA) is not real
            values = torch.full((4,), 2.0, device=CUDA)
            dist.all_reduce(values)
            torch.cuda.synchronize()
            assert values.tolist() == [2.0] * 4
            raise KeyError("the step failed")
        assert nccl_group._get_backend(CUDA) is real
    values = torch.full((4,), 3.0, device=CUDA)
    dist.all_reduce(values)  # NCCL again: a one-rank sum is the value itself, and it completes
    torch.cuda.synchronize()
    assert values.tolist() == [3.0] * 4


def test_a_probe_whose_step_all_reduces_on_nccl_leaves_the_group_working(
    nccl_group: Any,
) -> None:
    real = nccl_group._get_backend(CUDA)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reduced: list[int] = []

    def train_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the mean loss for logging, as training loops do
        reduced.append(int(inputs.shape[0]))
        optimizer.step()
        optimizer.zero_grad()
        return loss

    sample = (torch.randn(8, 256, device=CUDA), torch.randint(0, 10, (8,), device=CUDA))
    tuned = tune(
        model,
        sample,
        effective_batch_size=512,
        optimizer=optimizer,
        train_step=train_step,
        step_includes_update=True,
        device="cuda:0",
        use_store=False,
    )
    assert tuned.plan.effective_batch_size == 512
    assert reduced, "the train_step never ran"
    assert nccl_group._get_backend(CUDA) is real
    total = torch.ones(2, device=CUDA)
    dist.all_reduce(total)
    torch.cuda.synchronize()
    assert total.tolist() == [1.0, 1.0]
