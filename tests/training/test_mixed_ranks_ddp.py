"""``autotune(mixed_ranks=True)`` on 2 and 4 gloo ranks whose simulated cards differ in memory
and in step time, then the Accumulator with :class:`MixedBatchSampler` under DDP and FSDP2: each
rank probes its own card alone, every rank gets the same mixed plan with its own micro-batch, a
larger (and faster) card a larger one, the rows of each optimizer step are the effective batch
exactly (each row on one rank), and every step applies the float64 gradient of the whole global
batch (computed in one process) to 1e-12.

Step times: a trial's ``step_seconds`` is the wall time of its steps. A fake clock stands in for
``time`` in :mod:`autobatch.probing._trials` (the one place a trial is timed), and the step
advances it by the simulated card's time, ``fixed + per_sample x rows``, so each rank's profile
holds its card's line exactly (the CPU's own time does not count, loaded or not)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autobatch.errors import ConfigError
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

GROUP_TIMEOUT_S = 120
LR = 0.5
CARDS = {  # capacity in MiB, then the simulated step: fixed seconds, seconds per row
    "small": (2, 0.05, 0.02),
    "large": (4, 0.03, 0.01),
}
MIXES = {2: ("small", "large"), 4: ("small", "large", "small", "large")}
EFFECTIVE = {2: 192, 4: 384}
NUM_GLOBAL_BATCHES = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1)).double()


def _data(world_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    rows = NUM_GLOBAL_BATCHES * EFFECTIVE[world_size]
    return torch.randn(rows, 16, generator=g, dtype=torch.float64)


class _Clock:
    """``time`` for the trials: the simulated seconds of the steps so far, and only those, so
    each trial's step time is its card's line exactly, however loaded the machine is."""

    def __init__(self) -> None:
        self.simulated_seconds = 0.0

    def perf_counter(self) -> float:
        return self.simulated_seconds


def _truth(world_size: int, orders: list[list[int]]) -> list[list[torch.Tensor]]:
    """Parameters after each optimizer step, in one process: SGD on the gradient of the mean
    over every row of the global batch (``orders``: each global batch's rows)."""
    model, data = _model(), _data(world_size)
    after = []
    for rows in orders:
        model.zero_grad()
        (model(data[rows]) ** 2).mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad  # type: ignore[operator]
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def _full(param: torch.Tensor) -> torch.Tensor:
    full = getattr(param, "full_tensor", None)  # an FSDP2 shard: gathered (every rank calls)
    return (full() if full is not None else param).detach().clone()


def _fsdp2_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    return model


def _tune_and_train(model: nn.Module, rank: int, world_size: int, clock: _Clock) -> dict[str, Any]:
    from autobatch.device._simulated import SimulatedDevice
    from autobatch.training import Accumulator, MixedBatchSampler
    from autobatch.tuning import tune

    capacity_mib, fixed, per_row = CARDS[MIXES[world_size][rank]]

    def train_step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        clock.simulated_seconds += fixed + per_row * batch.shape[0]
        return (module(batch) ** 2).mean()

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tuned = tune(
        model,
        torch.randn(4, 16, dtype=torch.float64),
        effective_batch_size=EFFECTIVE[world_size],
        optimizer=optimizer,
        train_step=train_step,
        device=SimulatedDevice(capacity_bytes=capacity_mib * 2**20, step_seconds=None),
        use_store=False,
        mixed_ranks=True,
    )
    plan = tuned.plan
    data = _data(world_size)
    sampler = MixedBatchSampler.from_plan(len(data), plan, seed=3)
    sampler.set_epoch(1)
    shares = list(sampler)
    refused = ""
    other = plan.rank_micro_batch_sizes[(rank + 1) % world_size]  # type: ignore[index]
    try:  # another rank's plan
        Accumulator(
            model,
            optimizer,
            plan=dataclasses.replace(
                plan,
                micro_batch_size=other,
                micro_batch_sizes=(other,) * plan.gradient_accumulation_steps,
                max_micro_batch_size=max(other, plan.max_micro_batch_size),
            ),
        )
    except ConfigError as exc:
        refused = str(exc)
    acc = Accumulator(model, optimizer, plan=plan)
    counts, after = [], []
    for window in acc.windows(data[rows] for rows in shares):
        for micro in window:
            with micro.sync_context():
                micro.backward((model(micro.batch) ** 2).mean())
        stats = window.step()
        counts.append([stats.local_count, stats.global_count, stats.num_micro_steps])
        after.append([_full(p) for p in model.parameters()])
    return {
        "plan": plan.to_dict(),
        "profile_max": tuned.profile.max_micro_batch_size,
        "shares": shares,
        "counts": counts,
        "refused_plan": refused,
        "after": [[p.tolist() for p in window] for window in after],
    }


def _worker(rank: int, world_size: int, tmp: str) -> None:
    import autobatch.probing._trials as trials

    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    clock = _Clock()
    trials.time = clock  # type: ignore[assignment]
    result: dict[str, Any] = {}
    try:
        ddp_model = torch.nn.parallel.DistributedDataParallel(_model())
        result["ddp"] = _tune_and_train(ddp_model, rank, world_size, clock)
        result["fsdp"] = _tune_and_train(_fsdp2_model(), rank, world_size, clock)
        if world_size == 2:
            result["refused"] = _one_rank_fails(rank)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


def _one_rank_fails(rank: int) -> str:
    """Rank 1's card cannot hold the model: it raises why, rank 0 is told which rank failed."""
    from autobatch.device._simulated import SimulatedDevice
    from autobatch.tuning import autotune

    capacity = 2**20 if rank == 0 else 4096
    try:
        autotune(
            _model(),
            torch.randn(4, 16, dtype=torch.float64),
            loss_fn=lambda out: (out**2).mean(),
            effective_batch_size=64,
            device=SimulatedDevice(capacity_bytes=capacity, step_seconds=None),
            use_store=False,
            mixed_ranks=True,
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow  # gloo ranks in spawned processes
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_ranks_plan_per_card_and_train_the_exact_global_batch(
    tmp_path: Path, world_size: int
) -> None:
    spawn_and_wait(_worker, (world_size, str(tmp_path)), world_size, timeout_s=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    effective = EFFECTIVE[world_size]
    for name in ("ddp", "fsdp"):
        plans = [result[name]["plan"] for result in ranks]
        sizes = plans[0]["rank_micro_batch_sizes"]
        steps = plans[0]["gradient_accumulation_steps"]
        assert sum(sizes) * steps == effective, name
        for rank, plan in enumerate(plans):
            assert plan["rank_micro_batch_sizes"] == sizes, name
            assert plan["gradient_accumulation_steps"] == steps, name
            assert plan["micro_batch_size"] == sizes[rank], name
            assert sizes[rank] <= ranks[rank][name]["profile_max"], name
            assert plan["effective_batch_size"] == effective and plan["exact"], name
        small = [sizes[r] for r, card in enumerate(MIXES[world_size]) if card == "small"]
        large = [sizes[r] for r, card in enumerate(MIXES[world_size]) if card == "large"]
        assert min(large) > max(small), (name, sizes)  # the larger, faster card takes more
        # Rows per optimizer step: every row of each global batch on exactly one rank.
        orders = []
        for batch in range(NUM_GLOBAL_BATCHES):
            rows = [
                row
                for result in ranks
                for share in result[name]["shares"][batch * steps : (batch + 1) * steps]
                for row in share
            ]
            assert len(rows) == len(set(rows)) == effective, name
            orders.append(sorted(rows))
        assert sorted(r for rows in orders for r in rows) == list(range(2 * effective))
        truth = _truth(world_size, orders)
        for rank, result in enumerate(ranks):
            run = result[name]
            own = sizes[rank] * steps
            assert run["counts"] == [[own, effective, steps]] * NUM_GLOBAL_BATCHES, name
            error = max(
                float((torch.tensor(got, dtype=torch.float64) - want).abs().max())
                for got_window, want_window in zip(run["after"], truth, strict=True)
                for got, want in zip(got_window, want_window, strict=True)
            )
            assert error <= 1e-12, (name, rank, error)
            assert (
                f"the mixed plan gives rank {rank} (this one) micro-batches of {sizes[rank]}"
                in (run["refused_plan"])
            )
    if world_size == 2:
        assert ranks[1]["refused"].startswith("DoesNotFitError"), ranks[1]["refused"]
        assert ranks[0]["refused"].startswith("DistributedError: rank 1 failed while probing"), (
            ranks[0]["refused"]
        )
