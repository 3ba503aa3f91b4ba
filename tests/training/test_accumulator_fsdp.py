"""The Accumulator under FSDP2 (``fully_shard``) and DDP on 2 gloo ranks, with unequal counts per
rank: every optimizer step applies exactly the float64 gradient of the global mean over the
window's counted items (computed in one process, on an unsharded copy), FSDP2 reduce-scatters
once per window (its own ``set_requires_gradient_sync``), and what the Accumulator cannot drive is
refused when it is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autobatch.errors import ConfigError
from autobatch.profile import GradientSync
from autobatch.training._accumulator import Accumulator
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker
from tests.planning.test_planner import plan

WORLD_SIZE = 2
GROUP_TIMEOUT_S = 60
STEPS = 4
ROWS = {0: 2, 1: 10}  # counted items (rows) per micro-batch: 2 on rank 0, 10 on rank 1
NUM_MICRO_BATCHES = 6  # windows of 4, then a short one of 2
LR = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 1)).double()


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randn(ROWS[rank], 4, generator=g, dtype=torch.float64)
        for _ in range(NUM_MICRO_BATCHES)
    ]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The mean over the micro-batch's rows (its counted items)."""
    return (model(batch) ** 2).mean()


def _truth() -> list[list[torch.Tensor]]:
    """Parameters after each window, in one process on an unsharded float64 copy: SGD on the
    gradient of the mean over every row of both ranks' micro-batches of the window."""
    model = _model()
    data = {rank: _batches(rank) for rank in range(WORLD_SIZE)}
    after = []
    for start in range(0, NUM_MICRO_BATCHES, STEPS):
        rows = torch.cat([b for rank in data for b in data[rank][start : start + STEPS]])
        model.zero_grad()
        (model(rows) ** 2).mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad  # type: ignore[operator]
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def _train(model: nn.Module, rank: int) -> dict[str, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=STEPS)
    counts, after = [], []
    for window in acc.windows(_batches(rank), count_fn=len):
        for micro in window:
            with micro.sync_context():
                micro.backward(_loss(model, micro.batch))
        stats = window.step()
        counts.append([stats.local_count, stats.global_count, stats.num_micro_steps])
        after.append([_full(p) for p in model.parameters()])
    return {"world_size": acc.world_size, "counts": counts, "after": after}


def _full(param: torch.Tensor) -> torch.Tensor:
    full = getattr(param, "full_tensor", None)  # an FSDP2 shard: gathered (every rank calls)
    return (full() if full is not None else param).detach().clone()


def _fsdp2_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0])
    fully_shard(model)  # two parameter groups: the block's and the root's head
    return model


def _counting_reduce_scatters() -> list[int]:
    """Counts FSDP2's reduce-scatters in this process (FSDP2 calls it through ``dist``)."""
    calls = [0]
    original = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting  # type: ignore[assignment]
    return calls


def _refusals(rank: int) -> dict[str, str]:
    """What the Accumulator refuses at construction under 2 ranks, by name."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    refused: dict[str, str] = {}

    def attempt(name: str, build: Any) -> None:
        try:
            build()
        except ConfigError as exc:
            refused[name] = str(exc)

    sharded = _fsdp2_model()
    sgd = torch.optim.SGD(sharded.parameters(), lr=LR)
    attempt(
        "split", lambda: Accumulator(sharded, sgd, gradient_accumulation_steps=2, on_oom="split")
    )
    fsdp1 = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"), use_orig_params=True)
    attempt(
        "fsdp1",
        lambda: Accumulator(
            fsdp1, torch.optim.SGD(fsdp1.parameters()), gradient_accumulation_steps=2
        ),
    )
    one_rank = plan(16, effective_batch_size=64)  # world size 1
    attempt("world", lambda: Accumulator(sharded, sgd, plan=one_rank))
    unsynced = plan(16, effective_batch_size=128, world_size=2)
    measured_plainly = type(unsynced).from_dict(
        {
            **unsynced.to_dict(),
            "source": "measured",
            "gradient_sync": GradientSync(mode="none").to_dict(),
        }
    )
    attempt("mode", lambda: Accumulator(sharded, sgd, plan=measured_plainly))
    measured_ddp = type(unsynced).from_dict(
        {
            **unsynced.to_dict(),
            "source": "measured",
            "gradient_sync": GradientSync(
                mode="once_per_window", wrapper="DistributedDataParallel", num_micro_steps=2
            ).to_dict(),
        }
    )
    attempt("wrapper", lambda: Accumulator(sharded, sgd, plan=measured_ddp))
    measured_here = type(unsynced).from_dict(
        {
            **unsynced.to_dict(),
            "source": "measured",
            "gradient_sync": GradientSync(
                mode="once_per_window", wrapper="FSDP2 (fully_shard)", num_micro_steps=2
            ).to_dict(),
        }
    )
    accepted = Accumulator(sharded, sgd, plan=measured_here)
    refused["accepted_steps"] = str(accepted.gradient_accumulation_steps)
    return refused


def _worker(rank: int, tmp: str) -> None:
    join_gloo_group(rank, WORLD_SIZE, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    result: dict[str, Any] = {}
    try:
        truth = _truth()
        reduce_scatters = _counting_reduce_scatters()
        fsdp = _train(_fsdp2_model(), rank)
        result["fsdp_reduce_scatters"] = reduce_scatters[0]
        ddp = _train(torch.nn.parallel.DistributedDataParallel(_model()), rank)
        for name, run in (("fsdp", fsdp), ("ddp", ddp)):
            result[name] = {
                "world_size": run["world_size"],
                "counts": run["counts"],
                "error": max(
                    float((got - want).abs().max())
                    for got_window, want_window in zip(run["after"], truth, strict=True)
                    for got, want in zip(got_window, want_window, strict=True)
                ),
                "moved": max(
                    float((got - want).abs().max())
                    for got, want in zip(run["after"][-1], _model().parameters(), strict=True)
                ),
            }
        result["refused"] = _refusals(rank)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


@pytest.mark.slow  # gloo ranks in spawned processes
def test_fsdp2_and_ddp_windows_apply_the_float64_global_mean_with_unequal_counts(
    tmp_path: Path,
) -> None:
    spawn_and_wait(_worker, (str(tmp_path),), WORLD_SIZE, timeout_s=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for rank, result in enumerate(ranks):
        for name in ("fsdp", "ddp"):
            run = result[name]
            assert run["world_size"] == 2, name
            # 4 micro-batches of 2 rows with 4 of 10; then the short window: 2 of 2 with 2 of 10
            assert run["counts"] == [[[8, 40][rank], 48, 4], [[4, 20][rank], 24, 2]], name
            assert run["error"] <= 1e-12, (name, run["error"])
            assert run["moved"] > 1e-3, name  # the parameters did move: the check has teeth
        # One reduce-scatter per parameter group per window (2 groups, 2 windows), where
        # reducing at every micro-step would be 2 per micro-step (12).
        assert result["fsdp_reduce_scatters"] == 4
        refused = result["refused"]
        assert "on_oom='split'" in refused["split"]
        assert "all-gathers its parameters from every rank" in refused["split"]
        assert "FSDP1 (FullyShardedDataParallel)" in refused["fsdp1"]
        assert "fully_shard" in refused["fsdp1"]
        assert "the plan is for 1 data-parallel rank(s)" in refused["world"]
        assert "this loop has 2 (the group FSDP2 (fully_shard) uses)" in refused["world"]
        assert "measured with no gradient reduction across ranks" in refused["mode"]
        assert "unsharded gradients (the whole model's)" in refused["mode"]
        assert "the gradient reduction of DistributedDataParallel skipped" in refused["wrapper"]
        assert refused["accepted_steps"] == "4"


CAPACITY = "sim:10MiB"
CAPACITY_BYTES = 10 * 2**20
EFFECTIVE = 440  # 220 per rank: 55 x 4 as measured now, 110 x 2 as measured before


def _wide_sharded() -> nn.Module:
    """An FSDP2 model whose parameters weigh more than its activations: 1.5 MiB of unsharded
    gradients, against about 26 KiB of activations per sample."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64)) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(64, 10))
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _window_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, acc: Accumulator, size: int
) -> int:
    """Peak bytes of the second of two windows of ``acc`` at micro-batch ``size`` (the first
    creates Adam's state, as the probe's warm-up does), on a simulated card large enough that
    nothing is refused: the peak, beside the capacity the plan was made for."""
    from autobatch.device._simulated import SimulatedDevice
    from autobatch.probing._snapshot import resident_tensors

    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(size, 64, generator=g), torch.randint(0, 10, (size,), generator=g))
        for _ in range(2 * acc.gradient_accumulation_steps)
    ]
    windows = acc.windows(batches)

    def run(window: Any) -> None:
        for micro in window:
            with micro.sync_context():
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
        window.step()

    run(next(windows))
    device = SimulatedDevice(capacity_bytes=64 * CAPACITY_BYTES)
    with device.measure(resident_tensors(model, optimizer)) as peak:
        run(next(windows))
    for _ in windows:  # the end of the micro-batches: the ranks' last agreement
        pass
    return peak.allocated_bytes


def _sync_mode_worker(rank: int, tmp: str) -> None:
    import dataclasses

    import torch.nn.functional as F

    from autobatch.device import resolve_device
    from autobatch.distributed._consensus import ProcessGroupConsensus
    from autobatch.planning import PlanRequest, plan_request
    from autobatch.probing._options import ProbeOptions, StepSpec
    from autobatch.probing._prober import run_probe
    from autobatch.tuning import tune

    join_gloo_group(rank, WORLD_SIZE, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    result: dict[str, Any] = {}
    try:
        model = _wide_sharded()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sample = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
        tuned = tune(
            model,
            sample,
            effective_batch_size=EFFECTIVE,
            optimizer=optimizer,
            loss_fn=F.cross_entropy,
            device=CAPACITY,
            use_store=False,
        )
        result["mode"] = tuned.profile.gradient_sync.to_dict()
        result["plan_mode"] = tuned.plan.gradient_sync.to_dict()
        result["plan"] = [tuned.plan.micro_batch_size, tuned.plan.gradient_accumulation_steps]
        result["notes"] = list(tuned.profile.notes)
        acc = Accumulator(model, optimizer, plan=tuned.plan)
        result["peak"] = _window_peak(model, optimizer, acc, tuned.plan.micro_batch_size)
        # The same probe measured the other way: one micro-step per trial, reduced.
        step = StepSpec.build(model, sample, optimizer=optimizer, loss_fn=F.cross_entropy)
        options = ProbeOptions.build(
            step, device=resolve_device(CAPACITY), consensus=ProcessGroupConsensus()
        )
        one_step = run_probe(step, dataclasses.replace(options, gradient_sync=GradientSync()))
        old = plan_request(
            one_step, PlanRequest(effective_batch_size=EFFECTIVE, world_size=WORLD_SIZE)
        )
        result["old_plan"] = [old.micro_batch_size, old.gradient_accumulation_steps]
        try:
            Accumulator(model, optimizer, plan=old)
        except ConfigError as exc:
            result["old_refused"] = str(exc)
        anyway = Accumulator(
            model, optimizer, gradient_accumulation_steps=old.gradient_accumulation_steps
        )
        result["old_peak"] = _window_peak(model, optimizer, anyway, old.micro_batch_size)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


@pytest.mark.slow  # gloo ranks in spawned processes
def test_the_plan_measured_in_the_loops_sync_mode_fits_the_loop_and_another_is_refused(
    tmp_path: Path,
) -> None:
    # A loop that skips FSDP2's reduce-scatter holds the whole model's unsharded gradients
    # between micro-steps; a probe of one reduced micro-step plans a micro-batch that
    # goes over the card in such a loop.
    spawn_and_wait(_sync_mode_worker, (str(tmp_path),), WORLD_SIZE, timeout_s=420)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for result in ranks:
        measured = {
            "mode": "once_per_window",
            "wrapper": "FSDP2 (fully_shard)",
            "num_micro_steps": 2,
        }
        assert result["mode"] == result["plan_mode"] == measured
        assert any("gradient reduction skipped" in note for note in result["notes"])
        size, steps = result["plan"]
        assert steps > 1  # the loop skips the reduction between micro-steps
        assert result["peak"] <= CAPACITY_BYTES, result
        old_size, _ = result["old_plan"]
        assert old_size > size
        assert result["old_peak"] > CAPACITY_BYTES, result  # it would run out of memory
        assert (
            "the plan was measured without a recorded gradient-sync mode" in (result["old_refused"])
        )
    assert ranks[0]["plan"] == ranks[1]["plan"]
