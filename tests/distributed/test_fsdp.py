"""Probing models sharded with FSDP2 (``fully_shard``) on 2 gloo ranks on CPU: an out-of-memory
error on one rank never leaves the other waiting in a collective, both ranks get the same plan,
and the model trains afterwards. A layout that cannot be probed safely is refused at once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autobatch import autotune, probe
from autobatch.device._simulated import SimulatedDevice
from autobatch.distributed._layout import collective_layout
from autobatch.profile import Trial
from autobatch.tuning import tune
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker
from tests.helpers.sharded import sharded_mlp

GROUP_TIMEOUT_S = 30
"""The process group's timeout: a rank left in a collective would wait this long, then fail."""


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]  # type: ignore[operator]


def _worker(rank: int, world_size: int, tmp: str) -> None:
    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    result: dict[str, Any] = {}
    try:
        model = sharded_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sample = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
        before = _local(model)
        trials: list[Trial] = []
        started = time.monotonic()
        tuned = tune(
            model,
            sample,
            effective_batch_size=8192,
            optimizer=optimizer,
            loss_fn=F.cross_entropy,
            device=["sim:48MiB", "sim:24MiB"][rank],
            use_store=False,
            on_trial=trials.append,
        )
        result["seconds"] = time.monotonic() - started
        result["notes"] = list(tuned.profile.notes)
        plan = tuned.plan
        result["plan"] = plan.to_dict()
        result["trials"] = [[t.micro_batch_size, t.fits, t.oom] for t in trials]
        result["restored"] = all(
            torch.equal(a, b) for a, b in zip(before, _local(model), strict=True)
        )
        result["untouched_optimizer"] = not optimizer.state
        losses = []
        for _ in range(3):  # trains afterwards, at the planned micro-batch
            inputs = sample[0].repeat(4, 1)[: plan.micro_batch_size]
            targets = sample[1].repeat(4)[: plan.micro_batch_size]
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        result["losses"] = losses
        try:
            probe(model, sample, loss_fn=F.cross_entropy, device="sim:48MiB")
        except Exception as exc:
            result["no_consensus_error"] = [type(exc).__name__, str(exc)]
        result["layout"] = collective_layout(model)
        result["fsdp1"] = _fsdp1(rank, sample)
        result["ddp"] = _ddp(rank, sample)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


def _fsdp1(rank: int, sample: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """FSDP1 on small simulated cards (2 MiB and 1 MiB): the same plan, and it trains after."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = FullyShardedDataParallel(mlp, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters())
    trials: list[Trial] = []
    plan = autotune(
        model,
        sample,
        # Large enough that no trial is capped below the 1 MiB card's limit (autotune never
        # tries past ceil(E / world_size)), so rank 1 really runs out where rank 0 does not.
        effective_batch_size=8192,
        optimizer=optimizer,
        loss_fn=F.cross_entropy,
        device=["sim:2MiB", "sim:1MiB"][rank],
        use_store=False,
        on_trial=trials.append,
    )
    loss = F.cross_entropy(model(sample[0]), sample[1])
    loss.backward()
    optimizer.step()
    result = {
        "plan": plan.to_dict(),
        "ooms": sum(t.oom for t in trials),
        "layout": collective_layout(model),
        "loss": float(loss.detach()),
    }
    # A device whose allocator raises in the middle of a step: refused before any trial.
    started = time.monotonic()
    try:
        autotune(
            model,
            sample,
            effective_batch_size=64,
            loss_fn=F.cross_entropy,
            device="cpu",
            use_store=False,
        )
    except Exception as exc:
        result["cpu_error"] = [type(exc).__name__, str(exc), time.monotonic() - started]
    return result


def _ddp(rank: int, sample: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """DDP (gradient all-reduce inside backward) on 2 MiB and 1 MiB: trials under no_sync."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = DistributedDataParallel(mlp)
    optimizer = torch.optim.AdamW(model.parameters())
    trials: list[Trial] = []
    started = time.monotonic()
    plan = autotune(
        model,
        sample,
        # Large enough that no trial is capped below the 1 MiB card's limit (autotune never
        # tries past ceil(E / world_size)), so rank 1 really runs out where rank 0 does not.
        effective_batch_size=8192,
        optimizer=optimizer,
        loss_fn=F.cross_entropy,
        device=["sim:2MiB", "sim:1MiB"][rank],
        use_store=False,
        on_trial=trials.append,
    )
    seconds = time.monotonic() - started
    loss = F.cross_entropy(model(sample[0]), sample[1])
    loss.backward()  # all-reduces: the ranks are in step again after the probe
    optimizer.step()
    return {
        "plan": plan.to_dict(),
        "ooms": sum(t.oom for t in trials),
        "seconds": seconds,
        "loss": float(loss.detach()),
        "grad_sync": model.require_backward_grad_sync,
    }


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    spawn_and_wait(_worker, (2, str(tmp)), 2, timeout_s=4 * GROUP_TIMEOUT_S)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_an_oom_on_one_fsdp2_rank_stops_no_rank_in_a_collective(
    fsdp2_ranks: list[dict[str, Any]],
) -> None:
    first, second = fsdp2_ranks

    # The smaller card ran out of memory where the larger one did not: rank 1 alone saw OOMs.
    assert any(oom for _, _, oom in second["trials"])
    assert not any(oom for _, _, oom in first["trials"])
    assert [size for size, *_ in first["trials"]] == [size for size, *_ in second["trials"]]
    # No rank waited in a collective until the group's timeout.
    assert first["seconds"] < GROUP_TIMEOUT_S and second["seconds"] < GROUP_TIMEOUT_S
    assert first["plan"] == second["plan"]
    plan = first["plan"]
    assert plan["world_size"] == 2
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * 2 == 8192
    assert any("fake process group" in note for note in first["notes"])
    largest_fitting = max(size for size, fits, _ in second["trials"] if fits)
    assert plan["micro_batch_size"] <= largest_fitting


@pytest.mark.slow
def test_the_fsdp2_model_is_restored_and_trains_afterwards(
    fsdp2_ranks: list[dict[str, Any]],
) -> None:
    for rank in fsdp2_ranks:
        assert rank["restored"] and rank["untouched_optimizer"]
        losses = rank["losses"]
        assert all(loss == loss and loss < 10 for loss in losses)  # finite
        assert losses[-1] < losses[0]  # it learns: the same batch, three steps
    assert fsdp2_ranks[0]["losses"] == fsdp2_ranks[1]["losses"]  # one model, sharded


@pytest.mark.slow
def test_fsdp1_on_a_device_that_raises_mid_step_is_refused_at_once(
    fsdp2_ranks: list[dict[str, Any]],
) -> None:
    for rank in fsdp2_ranks:
        name, message, seconds = rank["fsdp1"]["cpu_error"]
        assert name == "ConfigError"
        assert "FSDP (FullyShardedDataParallel) on 2 ranks of cpu" in message
        assert "device='sim:" in message  # the alternative
        assert seconds < GROUP_TIMEOUT_S
        name, message = rank["no_consensus_error"]
        assert name == "ConfigError" and "got no consensus" in message
        assert rank["layout"] == "FSDP2 (fully_shard)"


@pytest.mark.slow
def test_fsdp1_ranks_agree_too(fsdp2_ranks: list[dict[str, Any]]) -> None:
    first, second = (rank["fsdp1"] for rank in fsdp2_ranks)

    assert first["layout"] == "FSDP (FullyShardedDataParallel)"
    assert first["plan"] == second["plan"]
    # The 1 MiB card ran out of memory at sizes the 2 MiB card ran; the plan is the smaller's.
    assert first["ooms"] < second["ooms"]
    assert first["loss"] == second["loss"] < 10


@pytest.mark.slow
def test_ddp_ranks_probe_without_gradient_sync_and_agree(
    fsdp2_ranks: list[dict[str, Any]],
) -> None:
    first, second = (rank["ddp"] for rank in fsdp2_ranks)

    assert first["plan"] == second["plan"]
    # Rank 1 ran out mid-step at sizes rank 0 ran; rank 0 did not wait in the all-reduce.
    assert first["ooms"] < second["ooms"]
    assert first["seconds"] < GROUP_TIMEOUT_S and second["seconds"] < GROUP_TIMEOUT_S
    assert first["grad_sync"] and second["grad_sync"]  # no_sync() ended with the probe
    assert first["loss"] == second["loss"] < 10


def test_a_plain_model_has_no_collective_layout() -> None:
    assert collective_layout(torch.nn.Linear(2, 2)) == ""


def test_a_simulated_device_deferring_oom_lets_the_step_end_then_raises_the_same_peak() -> None:
    raising = SimulatedDevice(capacity_bytes=1 << 20, name="small")
    deferring = raising.deferring_oom()
    ran_to_the_end = []
    oom = pytest.raises(torch.OutOfMemoryError, match="Simulated device small")
    with oom, deferring.measure([]) as peak:
        big = torch.zeros(1 << 19)  # 2 MiB: over the capacity
        del big
        ran_to_the_end.append(True)
    assert ran_to_the_end == [True]
    assert peak.allocated_bytes == 1 << 21
    assert deferring.capacity() == raising.capacity()
    with pytest.raises(torch.OutOfMemoryError), raising.measure([]):
        torch.zeros(1 << 19)
        ran_to_the_end.append(False)
    assert ran_to_the_end == [True]


def _forward_only_worker(rank: int, tmp: str) -> None:
    """One rank: a forward without a backward (the root stays unsharded), then a probe."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=1)
    result: dict[str, Any] = {}
    try:
        model = sharded_mlp()
        sample = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
        before = _local(model)
        with torch.no_grad():
            expected = model(sample[0])  # no backward follows: FSDP2 keeps the root gathered
        tuned = tune(
            model,
            sample,
            effective_batch_size=64,
            loss_fn=F.cross_entropy,
            device="sim:64MiB",
            use_store=False,
        )
        result["micro_batch_size"] = tuned.plan.micro_batch_size
        after = _local(model)
        result["restored"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        with torch.no_grad():
            result["same_output"] = torch.equal(model(sample[0]), expected)
    except Exception as exc:
        result["error"] = repr(exc)
    finally:
        (Path(tmp) / "forward_only.json").write_text(json.dumps(result))
        leave_gloo_worker()


@pytest.mark.slow
def test_a_probe_after_a_forward_without_backward_restores_the_sharded_model(
    tmp_path: Path,
) -> None:
    # The root's gathered parameters were snapshotted and written back after they were freed:
    # the process died with a segfault (hence a process of its own here).
    spawn_and_wait(_forward_only_worker, (str(tmp_path),), 1, timeout_s=4 * GROUP_TIMEOUT_S)
    result = json.loads((tmp_path / "forward_only.json").read_text())
    assert result == {"micro_batch_size": 64, "restored": True, "same_output": True}
