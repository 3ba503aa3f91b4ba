"""autotune under torch.distributed: 2 and 3 gloo processes on CPU, each rank a simulated device of
its own capacity; every test is bounded by a timeout, so a hang fails instead of blocking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autobatch import autotune, plan_world_sizes, probe
from autobatch.device._simulated import SimulatedDevice
from autobatch.distributed._consensus import ProcessGroupConsensus, process_group_consensus
from autobatch.errors import DistributedError
from autobatch.probing._batch import BatchSource
from autobatch.probing._estimator import FakeStep
from autobatch.profile import Trial
from autobatch.store._store import ProfileStore
from tests.conftest import MODEL_CASES, spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

TIMEOUT_S = 120.0
CASE = MODEL_CASES[0]  # mlp-adam: a probe takes about a second


def capacity_for(micro_batch_size: int) -> int:
    """Bytes at which CASE fits about ``micro_batch_size`` samples (as conftest's fixture)."""
    model, sample, optimizer = CASE.build()
    fake = FakeStep(model, optimizer, BatchSource.from_sample(sample), loss_fn=CASE.loss_fn)
    return fake.peak_bytes(micro_batch_size) + 4096


def _fails_on(rank: int, above: int) -> Any:
    """A train_step that raises ValueError on ``rank`` for micro-batches larger than ``above``."""

    def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        if dist.get_rank() == rank and inputs.shape[0] > above:
            raise ValueError(f"rank {rank} cannot take {inputs.shape[0]} samples")
        return CASE.loss_fn(model(inputs), targets)  # type: ignore[misc]

    return step


def _worker(rank: int, world_size: int, calls: list[dict[str, Any]], tmp: str) -> None:
    """Each call: every rank's ``(total, foreign)`` bytes, the effective batch, an optional
    ``fail`` spec and a store folder; one result (plan and trials, or error) per call."""
    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=60)
    results: list[dict[str, Any]] = []
    try:
        for call in calls:
            model, sample, optimizer = CASE.build()
            total, foreign = call["devices"][rank]
            device = SimulatedDevice(capacity_bytes=total, foreign_memory_bytes=foreign)
            step = _fails_on(**call["fail"]) if call.get("fail") else None
            trials: list[Trial] = []
            try:
                plan = autotune(
                    model,
                    sample,
                    effective_batch_size=call["effective"],
                    optimizer=optimizer,
                    loss_fn=None if step else CASE.loss_fn,
                    train_step=step,
                    device=device,
                    store=Path(tmp, call["store"], f"rank{rank}.sqlite3"),
                    on_trial=trials.append,
                )
            except Exception as exc:
                results.append({"error": type(exc).__name__, "message": str(exc)})
                continue
            fitted = [t.micro_batch_size for t in trials if t.fits]
            results.append(
                {
                    "plan": plan.to_dict(),
                    "sizes": [t.micro_batch_size for t in trials],
                    "max_fitted": max(fitted, default=None),
                }
            )
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))
    leave_gloo_worker()


def run_ranks(
    tmp_path: Path, world_size: int, calls: list[dict[str, Any]]
) -> list[list[dict[str, Any]]]:
    """Run ``_worker`` on ``world_size`` ranks; per call, the ranks' results in rank order."""
    for call in calls:
        (tmp_path / call["store"]).mkdir(exist_ok=True)
    spawn_and_wait(_worker, (world_size, calls, str(tmp_path)), world_size, TIMEOUT_S)
    by_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    return [list(per_call) for per_call in zip(*by_rank, strict=True)]


def stored_rows(path: Path) -> int:
    if not path.exists():
        return 0
    with ProfileStore(path) as store:
        return len(store.list_profiles())


@pytest.fixture(scope="module")
def capacities() -> dict[int, int]:
    return {n: capacity_for(n) for n in (48, 56, 64)}


@pytest.fixture(scope="module")
def single_device_max(capacities: dict[int, int]) -> int:
    """What a single-device probe finds on the smallest card (the answer every rank must get)."""
    model, sample, optimizer = CASE.build()
    device = SimulatedDevice(capacity_bytes=capacities[48])
    profile = probe(model, sample, optimizer=optimizer, loss_fn=CASE.loss_fn, device=device)
    assert 44 <= profile.max_micro_batch_size <= 52
    return profile.max_micro_batch_size


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, capacities: dict[int, int]
) -> tuple[Path, list[list[dict[str, Any]]]]:
    """One 2-rank session (process start-up dominates, so every scenario shares it)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    total = capacities[64]
    busy = [(total, 0), (total, total - capacities[48])]  # same card; rank 1 shared
    same = [(total, 0), (total, 0)]
    calls = [
        {"devices": busy, "effective": 192, "store": "busy"},  # probe
        {"devices": busy, "effective": 192, "store": "busy"},  # cached
        {"devices": busy, "effective": 97, "store": "busy"},  # not divisible by 2
        {"devices": same, "effective": 128, "store": "first", "fail": {"rank": 1, "above": 0}},
        {"devices": same, "effective": 40, "store": "later", "fail": {"rank": 1, "above": 10}},
    ]
    return tmp, run_ranks(tmp, 2, calls)


@pytest.fixture(scope="module")
def three_ranks(
    tmp_path_factory: pytest.TempPathFactory, capacities: dict[int, int]
) -> tuple[Path, list[list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("three_ranks")
    mixed = [(capacities[64], 0), (capacities[56], 0), (capacities[48], 0)]
    same = [(capacities[64], 0)] * 3
    calls = [
        {"devices": mixed, "effective": 288, "store": "mixed"},
        {"devices": same, "effective": 192, "store": "first", "fail": {"rank": 1, "above": 0}},
    ]
    return tmp, run_ranks(tmp, 3, calls)


@pytest.mark.slow  # gloo ranks in spawned processes
def test_a_busier_card_lowers_the_plan_of_every_rank_and_only_rank_0_stores(
    two_ranks: tuple[Path, list[list[dict[str, Any]]]], single_device_max: int
) -> None:
    tmp, (probed, cached, odd, *_) = two_ranks

    assert probed[0]["max_fitted"] == single_device_max
    assert probed[0]["plan"] == probed[1]["plan"]  # the same plan everywhere
    assert probed[0]["sizes"] == probed[1]["sizes"]  # in step: the same trials
    assert probed[0]["plan"]["world_size"] == 2  # from the group
    assert probed[0]["plan"]["source"] == "measured"
    assert probed[0]["plan"]["micro_batch_size"] <= single_device_max
    assert [c["plan"]["source"] for c in cached] == ["cached", "cached"]
    assert cached[0]["plan"] == cached[1]["plan"]
    assert cached[0]["sizes"] == cached[1]["sizes"] == []  # no step ran
    assert [o["error"] for o in odd] == ["ConfigError", "ConfigError"]
    assert "use effective_batch_size=96 or 98" in odd[0]["message"]
    assert stored_rows(tmp / "busy" / "rank0.sqlite3") == 1
    assert not (tmp / "busy" / "rank1.sqlite3").exists()
    with ProfileStore(tmp / "busy" / "rank0.sqlite3") as store:
        ((_, profile),) = store.list_profiles()
    assert profile.max_micro_batch_size == single_device_max
    assert "smallest capacity" in " ".join(profile.notes)


@pytest.mark.slow  # gloo ranks in spawned processes
def test_three_different_cards_agree_on_the_smallest_and_store_nothing(
    three_ranks: tuple[Path, list[list[dict[str, Any]]]], single_device_max: int
) -> None:
    tmp, (results, _) = three_ranks

    assert [r["max_fitted"] for r in results] == [single_device_max] * 3
    assert results[0]["plan"] == results[1]["plan"] == results[2]["plan"]
    assert results[0]["sizes"] == results[1]["sizes"] == results[2]["sizes"]
    assert results[0]["plan"]["world_size"] == 3
    # A profile of one kind of card must not answer for another: different cards, no cache.
    assert [stored_rows(tmp / "mixed" / f"rank{r}.sqlite3") for r in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("session", ["two_ranks", "three_ranks"])
@pytest.mark.slow  # gloo ranks in spawned processes
def test_a_step_failing_on_one_rank_fails_every_rank_without_a_hang(
    session: str, request: pytest.FixtureRequest
) -> None:
    tmp, calls = request.getfixturevalue(session)
    results = next(c for c in calls if "rank 1 cannot" in c[1].get("message", ""))
    world_size = len(results)

    errors = [r.get("error") for r in results]
    assert errors == ["DistributedError", "StepFailedError", "DistributedError"][:world_size]
    assert "rank 1 failed at micro-batch 1" in results[0]["message"]
    assert "rank 1 cannot take 1 samples" in results[1]["message"]
    assert [stored_rows(tmp / "first" / f"rank{r}.sqlite3") for r in range(world_size)] == [
        0
    ] * world_size


@pytest.mark.slow  # gloo ranks in spawned processes
def test_a_later_failure_on_one_rank_is_an_upper_bound_for_every_rank(
    two_ranks: tuple[Path, list[list[dict[str, Any]]]],
) -> None:
    _, calls = two_ranks
    first, second = calls[4]

    assert first["plan"] == second["plan"]
    assert first["sizes"] == second["sizes"]
    # rank 1 fails above 10: every rank searched below it and found 10 exactly
    assert first["max_fitted"] == second["max_fitted"] == 10
    assert first["plan"]["micro_batch_size"] == 10
    assert any("11 failed for a reason other than memory" in n for n in first["plan"]["notes"])


def test_without_a_process_group_there_is_no_consensus() -> None:
    assert process_group_consensus() is None
    with pytest.raises(DistributedError, match="init_process_group"):
        ProcessGroupConsensus()


@pytest.mark.parametrize(
    ("limit", "effective", "world_sizes", "options", "want"),
    [
        # (micro_batch_size, accumulation steps) per world size; None when infeasible
        (32, 256, [1, 2, 4, 8, 16], {}, [(32, 8), (32, 4), (32, 2), (32, 1), (16, 1)]),
        (48, 96, [1, 2, 3, 4, 5, 6], {}, [(48, 2), (48, 1), (32, 1), (24, 1), None, (16, 1)]),
        (10, 120, [1, 2, 4], {"multiple_of": 4}, [(8, 15), (4, 15), None]),
        (64, 512, [1, 2, 4], {"max_gradient_accumulation_steps": 4}, [None, (64, 4), (64, 2)]),
        (7, 30, [1, 2, 3], {"uneven": "never"}, [(6, 5), (5, 3), (5, 2)]),
    ],
)
def test_plan_world_sizes_table(
    limit: int,
    effective: int,
    world_sizes: list[int],
    options: dict[str, Any],
    want: list[tuple[int, int] | None],
) -> None:
    rows = plan_world_sizes(
        limit, effective_batch_size=effective, world_sizes=world_sizes, **options
    )

    got = [
        None
        if row.plan is None
        else (row.plan.micro_batch_size, row.plan.gradient_accumulation_steps)
        for row in rows
    ]
    assert got == want
    for row in rows:
        if row.plan is None:
            assert row.reason
            continue
        p = row.plan
        assert sum(p.micro_batch_sizes) * p.world_size == p.effective_batch_size == effective
        assert p.micro_batch_size <= limit and p.world_size == row.world_size
        assert p.micro_batch_size % options.get("multiple_of", 1) == 0
