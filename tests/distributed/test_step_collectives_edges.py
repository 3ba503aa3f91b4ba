"""What a probe's faked process groups
(:func:`autobatch.distributed._fake_backend.process_groups_faked`)
cannot run, on 2 gloo ranks on CPU: a ``train_step`` that needs the other ranks is refused on
every rank however it reaches torch.distributed, a block inside another leaves the outer one's
fakes in place, and autotune inside one refuses to agree over nothing. Afterwards every group
communicates, keeps its backend, a second autotune works and the process group is destroyed
cleanly. The group timeout is short, so a rank left waiting fails the test instead of blocking it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import broadcast_object_list  # bound before any probe patches a name

from autobatch.tuning import tune
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

GROUP_TIMEOUT_S = 20
"""The process group's timeout: a rank left in a collective would wait this long, then fail."""


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _tune(rank: int, extra: Any) -> dict[str, Any]:
    """tune() on 2 ranks whose cards differ (rank 1 runs out of memory where rank 0 does not),
    with a train_step that calls ``extra()`` after backward: the plan, or the error."""
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        extra()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    try:
        tuned = tune(
            model,
            (torch.randn(8, 64), torch.randint(0, 10, (8,))),
            effective_batch_size=8192,
            optimizer=optimizer,
            train_step=train_step,
            step_includes_update=True,
            device=["sim:2MiB", "sim:1MiB"][rank],
            use_store=False,
        )
    except Exception as exc:
        return {"error": [type(exc).__name__, str(exc)]}
    return {"plan": tuned.plan.to_dict()}


def _refused(rank: int, groups: dict[str, Any]) -> dict[str, Any]:
    """Steps that need the other ranks (broadcast_object_list imported from torch.distributed,
    a new group in every step, a 2-D DeviceMesh made in the step, a group made by rank 0 alone),
    and one that runs most other collectives."""
    from torch.distributed.device_mesh import init_device_mesh

    def direct_broadcast() -> None:
        box: list[Any] = [torch.ones(3)] if rank == 0 else [None]
        broadcast_object_list(box, src=0)

    def group_per_step() -> None:
        dist.all_reduce(torch.ones(2), group=dist.new_group([0, 1]))

    def mesh_in_step() -> None:  # the dp dimension needs groups of its own
        init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    sizes: list[int] = []

    def one_rank_creates() -> None:  # rank 0 alone, from its fifth step on
        sizes.append(1)
        if rank == 0 and len(sizes) > 4:
            dist.new_group([0, 1])

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def runs() -> None:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        # By name: the fake backend keeps the group's name, which these resolve.
        funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", groups["pair"]))
        world = init_device_mesh("cpu", (2,))  # the default group's, found by name
        DTensor.from_local(torch.ones(2), world, [Partial()]).full_tensor()
        tp = mesh["tp"]  # a 2-D mesh made before the probe
        sharded = DTensor.from_local(torch.ones(4), tp, [Shard(0)])
        sharded.redistribute(tp, [Replicate()]).to_local()
        (sharded * 2).sum().full_tensor()
        if rank == 0:  # a group rank 1 is not a member of
            dist.all_reduce(torch.ones(2), group=groups["alone"])
        dist.all_reduce(torch.ones(2), group=groups["local"])  # use_local_synchronization
        peer = 1 - rank
        dist.send(torch.ones(2), peer) if rank == 0 else dist.recv(torch.empty(2), peer)
        ops = [
            dist.P2POp(dist.isend, torch.ones(2), peer),
            dist.P2POp(dist.irecv, torch.empty(2), peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.barrier()
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4))
        dist.all_to_all_single(torch.empty(4), torch.ones(4))
        dist.all_gather_object([None, None], {"rank": rank})

    def recv_from_any() -> None:  # fails on the fake backend alone
        if rank == 0:
            dist.recv(torch.empty(2))
        else:
            dist.send(torch.ones(2), 0)

    cases = {
        "recv_any": recv_from_any,
        "direct": direct_broadcast,
        "new_group": group_per_step,
        "mesh": mesh_in_step,
        "one_rank": one_rank_creates,
        "runs": runs,
    }
    return {name: _tune(rank, extra) for name, extra in cases.items()}


def _nested(rank: int) -> dict[str, Any]:
    """A faked block inside another, and autotune inside one."""
    from autobatch.distributed._fake_backend import groups_faked, process_groups_faked

    result: dict[str, Any] = {}
    with process_groups_faked():
        with process_groups_faked():
            pass
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)  # still the outer block's fake backend: this rank's own value
        result["after_inner"] = [float(value), groups_faked()]
        result["autotune"] = _tune(rank, lambda: None)
    result["faked_after"] = groups_faked()
    return result


def _worker(rank: int, world_size: int, tmp: str, scenario: str) -> None:
    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    started = time.monotonic()
    pair = dist.new_group([0, 1])
    local = dist.new_group([0, 1], use_local_synchronization=True)
    alone = dist.new_group([0])  # rank 1 is not a member
    result: dict[str, Any] = {}
    try:
        groups = {"pair": pair, "local": local, "alone": alone}
        result.update(_refused(rank, groups) if scenario == "refused" else _nested(rank))
        sums = []
        for group in (None, pair, local):
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value, group=group)
            sums.append(float(value))
        result["sums"] = sums
        result["backends"] = [dist.get_backend(g) for g in (None, pair, local)]
        if rank == 0:
            result["backends"].append(dist.get_backend(alone))
        # A second probe in the same process, its step all-reducing: one plan on both ranks.
        result["second"] = _tune(rank, lambda: dist.all_reduce(torch.ones(2)))
        result["seconds"] = time.monotonic() - started
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()  # destroys the process group: fails the worker if that raises


def _run(tmp: Path, scenario: str) -> list[dict[str, Any]]:
    spawn_and_wait(_worker, (2, str(tmp), scenario), 2, timeout_s=3 * GROUP_TIMEOUT_S)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def _check_groups_back(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    # Neither rank waited for the group's timeout (a rank that did took at least that long).
    assert first["seconds"] < GROUP_TIMEOUT_S and second["seconds"] < GROUP_TIMEOUT_S, ranks
    # Every group communicates again (1 + 2 on both ranks) and keeps its backend.
    assert first["sums"] == second["sums"] == [3.0] * 3
    assert first["backends"] == ["gloo"] * 4 and second["backends"] == ["gloo"] * 3
    assert "plan" in first["second"], first["second"]
    assert first["second"] == second["second"]
    assert first["second"]["plan"]["world_size"] == 2


@pytest.mark.slow
def test_a_step_needing_the_other_ranks_is_refused_however_it_reaches_torch(
    tmp_path: Path,
) -> None:
    ranks = _run(tmp_path, "refused")
    for rank in ranks:
        # Imported from torch.distributed before the probe: refused too (a receiving rank used
        # to allocate by a garbage size: "does not fit even at micro-batch 1").
        kind, message = rank["direct"]["error"]
        assert kind == "PeerObjectError", rank["direct"]
        assert "torch.distributed.broadcast_object_list" in message
        # A group created in the step (a rank out of memory before it left the other waiting
        # in the creation for good); a DeviceMesh creates its groups the same way.
        for case in ("new_group", "mesh"):
            kind, message = rank[case]["error"]
            assert kind == "PeerObjectError", rank[case]
            assert "new_group" in message and "Create the group once, before the probe" in message
    # A step failing inside torch.distributed on the fake backend says why (before: only
    # "sourceRank() may only be called on work objects that correspond to a recv ...").
    kind, message = ranks[0]["recv_any"]["error"]
    assert kind == "StepFailedError" and "sourceRank()" in message, message
    assert "collectives go to a fake backend" in message and "move that collective" in message
    # Refused on rank 0 alone: rank 1 stops too, at once, naming rank 0.
    first, second = ranks
    assert first["one_rank"]["error"][0] == "PeerObjectError", first["one_rank"]
    kind, message = second["one_rank"]["error"]
    assert kind == "DistributedError" and message.startswith("rank 0 failed"), message
    # The rest runs, on both ranks, to one plan. A group reached by name (functional
    # collectives, a DeviceMesh over the default group) is found while faked: its name was its
    # backend's, '' on the fake one ("Could not resolve the process group registered under the
    # name ''").
    assert "plan" in first["runs"], first["runs"]
    assert first["runs"] == second["runs"]
    _check_groups_back(ranks)


@pytest.mark.slow
def test_a_faked_block_inside_another_and_autotune_inside_one(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "nested")
    for rank, result in enumerate(ranks):
        # The inner block left the outer one's fakes in place (no DistributedError "could not
        # give process group '' its own cpu backend (fake) back").
        assert result["after_inner"] == [float(rank + 1), True]
        assert result["faked_after"] is False
        # autotune inside a faked block refuses to agree over nothing, naming the fix.
        kind, message = result["autotune"]["error"]
        assert kind == "DistributedError", result["autotune"]
        assert "fake backend" in message and "Call autotune outside them" in message
    _check_groups_back(ranks)
