"""Data-parallel size: 4 gloo ranks with tensor parallel 2 (a 2 x 2 DeviceMesh ("dp", "tp")), so
2 data-parallel ranks: the plan divides the effective batch by 2, not 4, and says how."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autobatch import autotune, plan, plan_world_sizes
from autobatch.conditions import one_world_size
from autobatch.distributed._layout import collective_layout, world_size_of
from autobatch.errors import ConfigError
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

TIMEOUT_S = 120.0


def _tensor_parallel_mlp(mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _fsdp2_over_tensor_parallel(mesh: Any) -> torch.nn.Module:
    """2-D parallelism: tensor parallel over "tp", then FSDP2 over "dp"."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard(_tensor_parallel_mlp(mesh), mesh=mesh["dp"])


def _worker(rank: int, world_size: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=60)
    results: list[Any] = []
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _tensor_parallel_mlp(mesh)
        torch.manual_seed(1)  # the same sample on every rank (tensor-parallel peers share it)
        sample = (torch.randn(4, 32), torch.randint(0, 10, (4,)))
        store = Path(tmp, f"rank{rank}.sqlite3")
        calls: list[dict[str, Any]] = [
            {},  # the world's size would be wrong: refused
            {"process_group": mesh["dp"]},
            {"data_parallel_size": 2},  # the same answer, from the store
            {"data_parallel_size": 4, "process_group": mesh["dp"]},  # disagree
        ]
        for extra in calls:
            try:
                plan = autotune(
                    model,
                    sample,
                    effective_batch_size=64,
                    loss_fn=F.cross_entropy,
                    device="sim:1MiB",
                    store=store,
                    max_micro_batch_size=32,
                    **extra,
                )
                results.append(plan.to_dict())
            except Exception as exc:
                results.append([type(exc).__name__, str(exc)])
        results.append(collective_layout(model))
        results.append(collective_layout(_fsdp2_over_tensor_parallel(mesh)))
        hsdp = fully_shard(torch.nn.Linear(8, 8), mesh=mesh)  # replicate x shard: all dp
        results.append([collective_layout(hsdp), world_size_of(hsdp)])
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))
    leave_gloo_worker()


@pytest.fixture(scope="module")
def tp2_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    tmp = tmp_path_factory.mktemp("tp2")
    spawn_and_wait(_worker, (4, str(tmp)), 4, TIMEOUT_S)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_tensor_parallel_2_of_4_ranks_plans_over_2_data_parallel_ranks(
    tp2_ranks: list[list[Any]],
) -> None:
    for refused, by_group, by_size, disagree, layout, two_d_layout, hsdp in tp2_ranks:
        assert refused[0] == "ConfigError"
        assert "DeviceMesh of shape (2,) ('tp',) in a world of 4" in refused[1]
        assert "pass world_size=N" in refused[1]
        assert by_group["world_size"] == 2
        m, k = by_group["micro_batch_size"], by_group["gradient_accumulation_steps"]
        assert m * k * 2 == by_group["effective_batch_size"] == 64
        assert by_group["notes"][-1] == (
            f"effective_batch_size 64 = {m} (micro_batch_size) x {k} "
            "(gradient_accumulation_steps) x 2 (data-parallel ranks)"
        )
        # The same plan from the store; its conditions say where the size came from.
        assert by_group["conditions"]["world_size_source"] == "argument process_group"
        # The alias data_parallel_size reaches the road as world_size.
        sourced = {**by_group["conditions"], "world_size_source": "argument world_size"}
        assert by_size == {**by_group, "source": "cached", "conditions": sourced}
        assert disagree[0] == "ConfigError"
        assert "world_size=4, process_group=2 disagree" in disagree[1]
        assert layout == "tensor parallel (DTensor parameters)"
        # Not FSDP2 alone: its tensor-parallel all-reduces are not FSDP's to fake.
        assert two_d_layout == "FSDP2 (fully_shard) with tensor parallel"
        assert hsdp == ["FSDP2 (fully_shard)", 4]  # HSDP: every rank is data-parallel
    assert all(ranks[1] == tp2_ranks[0][1] for ranks in tp2_ranks)  # one plan everywhere


def test_without_torch_distributed_the_data_parallel_size_is_what_is_said() -> None:
    model = torch.nn.Linear(2, 2)
    assert world_size_of(model) == 1
    assert world_size_of(model, world_size=8) == 8
    with pytest.raises(ConfigError, match="world_size 0 must be an int >= 1"):
        world_size_of(model, world_size=0)


def test_the_alias_data_parallel_size_is_reconciled_with_world_size_in_one_place() -> None:
    assert one_world_size(None, None) is None
    assert one_world_size(None, 8) == 8
    assert one_world_size(8, None) == 8
    assert one_world_size(8, 8) == 8
    assert one_world_size([1, 2], [1, 2]) == [1, 2]  # the CLI's table of sizes
    with pytest.raises(ConfigError, match="world_size 4 and data_parallel_size 8 disagree"):
        one_world_size(4, 8)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="world_size 4 and data_parallel_size 8 disagree"):
        autotune(
            model,
            torch.zeros(1, 2),
            effective_batch_size=64,
            world_size=4,
            data_parallel_size=8,
            device="sim:1GiB",
            use_store=False,
        )


def test_every_plan_for_more_than_one_rank_notes_the_formula_once() -> None:
    """The planner notes E = m x k x dp itself, so the CLI, the service and autotune cannot
    drop or repeat it."""
    one = plan(24, effective_batch_size=64)
    assert not any("data-parallel ranks" in note for note in one.notes)
    four = plan(24, effective_batch_size=64, world_size=4)
    assert four.notes == (four.formula(),)
    assert four.formula() == (
        "effective_batch_size 64 = 16 (micro_batch_size) x 1 (gradient_accumulation_steps) x 4 "
        "(data-parallel ranks)"
    )
    rows = plan_world_sizes(24, effective_batch_size=64, world_sizes=[1, 2, 3])
    assert [row.plan.notes.count(row.plan.formula()) for row in rows if row.plan] == [0, 1]
    assert rows[2].plan is None  # 64 is not a multiple of 3


def test_the_formula_names_uneven_micro_batches() -> None:
    text = plan(8, effective_batch_size=30, world_size=2, uneven="always").formula()
    assert text == (
        "effective_batch_size 30 = 15 (micro_batch_sizes summed over 2 "
        "gradient_accumulation_steps: 1 of 8, 1 of 7) x 2 (data-parallel ranks)"
    )
