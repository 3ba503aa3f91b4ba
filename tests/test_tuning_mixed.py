"""``autotune(mixed_ranks=True)`` in one process: a plan of one rank (its own micro-batch is
every rank's), and what it refuses by name: ranks it cannot share limits with, an inexact
effective batch. The ranks of a process group: tests/training/test_mixed_ranks_ddp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch.errors import ConfigError
from autobatch.tuning import TuneRequest, autotune


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return (output**2).mean()


def test_one_process_plans_its_own_rank() -> None:
    result = autotune(
        _model(),
        torch.randn(4, 16),
        loss_fn=_loss,
        effective_batch_size=96,
        device="sim:4MiB",
        use_store=False,
        mixed_ranks=True,
    )
    assert result.rank_micro_batch_sizes == (result.micro_batch_size,)
    assert result.micro_batch_size * result.gradient_accumulation_steps == 96
    assert result.source == "measured"
    assert result.capacity_bytes == 4 * 2**20
    assert result.predicted_peak_memory_bytes is not None
    assert result.budget is not None and result.budget.budget_bytes == 4 * 2**20


def test_several_ranks_without_a_process_group_are_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"mixed_ranks=True plans one micro-batch per rank of "
        r"the default process group \(1 rank\(s\): torch.distributed is not "
        r"initialised\), but the plan is for 2 data-parallel rank\(s\)",
    ):
        autotune(
            _model(),
            torch.randn(4, 16),
            loss_fn=_loss,
            effective_batch_size=96,
            world_size=2,
            device="sim:4MiB",
            use_store=False,
            mixed_ranks=True,
        )


def test_an_inexact_mixed_plan_is_refused_when_the_request_is_built() -> None:
    with pytest.raises(ConfigError, match="allow_inexact does not go with a mixed plan"):
        TuneRequest.build(
            _model(),
            torch.randn(4, 16),
            effective_batch_size=96,
            allow_inexact=True,
            mixed_ranks=True,
        )
