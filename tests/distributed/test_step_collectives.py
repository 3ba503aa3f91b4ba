"""Collectives the user's own ``train_step`` issues, on 2 gloo ranks on CPU: a rank that runs out of
memory before reaching one never leaves the other waiting in it. The ranks' simulated cards differ,
so one rank runs out at a size where the other does not; the step all-reduces after backward (a
logged loss, or ``clip_grad_norm_``'s norm over FSDP2's DTensor gradients). The process group's
timeout is short, so a rank left waiting fails the test instead of blocking it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autobatch.profile import Trial
from autobatch.tuning import tune
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker
from tests.helpers.sharded import sharded_mlp

GROUP_TIMEOUT_S = 20
"""The process group's timeout: a rank left in a collective would wait this long, then fail."""


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _worker(rank: int, world_size: int, tmp: str, scenario: str) -> None:
    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    result: dict[str, Any] = {}
    try:
        if scenario == "groups":
            result.update(_one_rank_communicates_alone(rank))
        else:
            result.update(_tuned(rank, fsdp2=scenario == "fsdp2_clip"))
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


def _tuned(rank: int, *, fsdp2: bool) -> dict[str, Any]:
    """tune() on both ranks with a train_step that all-reduces after backward, and after it a
    real all-reduce over the default group (and, for FSDP2, the DeviceMesh's)."""
    result: dict[str, Any] = {}
    model = sharded_mlp() if fsdp2 else _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reduced_at: list[int] = []  # sizes at which the step's own collective returned

    def train_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        if fsdp2:  # all-reduces the norm over the DeviceMesh's group
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        else:  # the mean loss over the ranks, for logging
            logged = loss.detach().clone()
            dist.all_reduce(logged)
        reduced_at.append(int(inputs.shape[0]))
        optimizer.step()
        optimizer.zero_grad()
        return loss

    sample = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    trials: list[Trial] = []
    started = time.monotonic()
    tuned = tune(
        model,
        sample,
        # Large enough that no trial is capped below the smaller card's limit (autotune
        # never tries past ceil(E / world_size)), so rank 1 runs out where rank 0 does not.
        effective_batch_size=8192,
        optimizer=optimizer,
        train_step=train_step,
        step_includes_update=True,
        device=(["sim:48MiB", "sim:24MiB"] if fsdp2 else ["sim:2MiB", "sim:1MiB"])[rank],
        use_store=False,
        on_trial=trials.append,
    )
    result["seconds"] = time.monotonic() - started
    result["plan"] = tuned.plan.to_dict()
    result["notes"] = list(tuned.profile.notes)
    result["trials"] = [[t.micro_batch_size, t.fits, t.oom] for t in trials]
    result["reduced_at"] = reduced_at
    # The real group is back: a collective after the probe communicates.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result["sum"] = float(total)
    if fsdp2:  # and the DeviceMesh's group too (a DTensor redistribute)
        param = next(iter(model.parameters()))
        result["mesh_sum"] = float(param.detach().full_tensor().sum())  # type: ignore[operator]
        result["local_sum"] = float(param.detach().to_local().sum())  # type: ignore[operator]
    return result


def _probe_steps_the_fake_backend_cannot_run(rank: int) -> dict[str, list[str]]:
    """tune() with a train_step that needs an object rank 0 sends (broadcast_object_list), and
    with one that calls monitored_barrier (which the fake backend lacks): each error's type and
    message on this rank."""

    def broadcast_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        box: list[Any] = [{"scale": 1.0}] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets) * box[0]["scale"]

    def barrier_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        dist.monitored_barrier()
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    errors: dict[str, list[str]] = {}
    for name, train_step in (("broadcast", broadcast_step), ("barrier", barrier_step)):
        try:
            tune(
                _mlp(),
                (torch.randn(8, 64), torch.randint(0, 10, (8,))),
                effective_batch_size=64,
                train_step=train_step,
                device="sim:2MiB",
                use_store=False,
            )
        except Exception as exc:
            errors[name] = [type(exc).__name__, str(exc)]
    return errors


def _one_rank_communicates_alone(rank: int) -> dict[str, Any]:
    """Inside ``process_groups_faked`` rank 0 alone runs collectives on every kind of group (the
    default one, a ``new_group``, a DeviceMesh's by object and by name, a DTensor redistribute),
    then raises; afterwards each of them communicates again."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from autobatch.distributed._fake_backend import process_groups_faked

    mesh = init_device_mesh("cpu", (2,))
    pair = dist.new_group([0, 1])
    backends = [type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__]  # type: ignore[union-attr]
    result: dict[str, Any] = {}
    for _ in range(2):  # the second time reuses each group's fake backend
        try:
            with process_groups_faked() as groups:
                result["groups"] = groups
                if rank == 0:
                    ones = torch.ones(3)
                    dist.all_reduce(ones)
                    dist.all_reduce(ones, group=pair)
                    dist.all_reduce(ones, group=mesh.get_group())
                    dist.broadcast(ones, src=1)
                    ones = funcol.wait_tensor(funcol.all_reduce(ones, "sum", mesh))
                    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
                    result["faked"] = [*ones.tolist(), *partial.full_tensor().tolist()]
                raise KeyError("the step failed")
        except KeyError:
            pass
    result["cannot_run"] = _probe_steps_the_fake_backend_cannot_run(rank)
    backends.append(type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__)  # type: ignore[union-attr]
    result["backends"] = backends
    mine = float(rank + 1)
    sums = []
    for group in (None, pair, mesh.get_group()):
        value = torch.tensor([mine])
        dist.all_reduce(value, group=group)
        sums.append(float(value))
    by_name = funcol.wait_tensor(funcol.all_reduce(torch.tensor([mine]), "sum", mesh))
    sums.append(float(by_name))
    partial = DTensor.from_local(torch.tensor([mine]), mesh, [Partial()])
    sums.append(float(partial.full_tensor()))
    result["sums"] = sums
    box: list[Any] = [{"from": rank}]
    dist.broadcast_object_list(box, src=0)  # torch's own again
    result["broadcast"] = box[0]
    return result


def _run(tmp: Path, scenario: str) -> list[dict[str, Any]]:
    spawn_and_wait(_worker, (2, str(tmp), scenario), 2, timeout_s=3 * GROUP_TIMEOUT_S)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def _check_one_agreed_answer(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    assert "plan" in first and "plan" in second, ranks
    # The ranks tried the same sizes; rank 1 ran out of memory at a size where rank 0 did not,
    # and at that size rank 0's step reached its own collective while rank 1's never did.
    assert [size for size, *_ in first["trials"]] == [size for size, *_ in second["trials"]]
    diverged = [
        size
        for (size, _, oom0), (_, _, oom1) in zip(first["trials"], second["trials"], strict=True)
        if oom1 and not oom0
    ]
    assert diverged
    assert any(s in first["reduced_at"] and s not in second["reduced_at"] for s in diverged)
    # Both ranks finished within seconds (none waited for the group's timeout), with one answer.
    assert first["seconds"] < GROUP_TIMEOUT_S and second["seconds"] < GROUP_TIMEOUT_S
    assert first["plan"] == second["plan"]
    assert first["plan"]["world_size"] == 2
    largest_fitting = max(size for size, fits, _ in second["trials"] if fits)
    assert 1 <= first["plan"]["micro_batch_size"] <= largest_fitting
    assert any("fake backend" in note for note in first["notes"])
    # The real group is back: 1 + 2 on both ranks.
    assert first["sum"] == second["sum"] == 3.0


@pytest.mark.slow
def test_collectives_of_one_rank_alone_go_nowhere_and_every_group_is_back_after(
    tmp_path: Path,
) -> None:
    first, second = _run(tmp_path, "groups")
    # Rank 0's collectives returned its own values (nothing came from rank 1, which ran none).
    assert first["faked"] == [1.0] * 6 and "faked" not in second
    # The default group, the new_group and the mesh's group (one of them: the mesh spans the
    # world, so it reuses the default group).
    assert first["groups"] == second["groups"] == 2
    # A step that needs an object another rank sends is refused on both ranks, with the fix; a
    # step the fake backend cannot run fails at micro-batch 1, saying why.
    for rank in (first, second):
        kind, message = rank["cannot_run"]["broadcast"]
        assert kind == "PeerObjectError", rank["cannot_run"]
        assert "torch.distributed.broadcast_object_list" in message and "fake backend" in message
        assert "Move broadcast_object_list out of the train_step" in message
        kind, message = rank["cannot_run"]["barrier"]
        assert kind == "StepFailedError" and "micro-batch 1" in message, rank["cannot_run"]
        assert "monitored_barrier is not supported" in message
    # Afterwards (the block raised both times, the probe failed) each group communicates again.
    assert first["sums"] == second["sums"] == [3.0] * 5
    assert first["broadcast"] == second["broadcast"] == {"from": 0}
    assert first["backends"] == ["ProcessGroupGloo", "ProcessGroupGloo"]


@pytest.mark.slow
def test_a_train_step_all_reducing_its_loss_leaves_no_rank_waiting(tmp_path: Path) -> None:
    _check_one_agreed_answer(_run(tmp_path, "all_reduce"))


@pytest.mark.slow
def test_fsdp2_with_clip_grad_norm_in_the_train_step_leaves_no_rank_waiting(
    tmp_path: Path,
) -> None:
    ranks = _run(tmp_path, "fsdp2_clip")
    _check_one_agreed_answer(ranks)
    # The DeviceMesh's group communicates again: the full parameter is both ranks' shards.
    first, second = ranks
    assert first["mesh_sum"] == second["mesh_sum"]
    assert first["mesh_sum"] == pytest.approx(first["local_sum"] + second["local_sum"], rel=1e-5)
