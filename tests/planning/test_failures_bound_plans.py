"""No plan at or above a size that failed in its own profile at a capacity no larger than the one
planned for; predictions stay below the smallest such failure."""

from __future__ import annotations

from typing import Any

import pytest

from autobatch.profile import MemoryModel, Profile, Trial
from tests.planning.test_planner import plan, plan_world_sizes

GIB = 2**30


def ran(micro_batch_size: int, peak_gib: float, *, warm_up: bool = False) -> Trial:
    return Trial(
        micro_batch_size=micro_batch_size,
        fits=True,
        peak_reserved_bytes=round(peak_gib * GIB),
        warm_up=warm_up,
    )


def oom(micro_batch_size: int) -> Trial:
    return Trial(micro_batch_size=micro_batch_size, fits=False, oom=True, error="OutOfMemoryError")


def profile(trials: tuple[Trial, ...], capacity_gib: float, **overrides: Any) -> Profile:
    fitting = [t.micro_batch_size for t in trials if t.fits and not t.warm_up]
    fields: dict[str, Any] = {
        "max_micro_batch_size": max(fitting),
        "recommended_micro_batch_size": max(fitting),
        "safety_margin": 0.05,
        "method": "probe",
        "trials": trials,
        "num_steps": len(trials) + 1,
        "device_name": "sim",
        "device_type": "sim",
        "total_memory_bytes": round(capacity_gib * GIB),
        "capacity_bytes": round(capacity_gib * GIB),
    }
    fields.update(overrides)
    return Profile(**fields)


def issue_first_case() -> Profile:
    """The issue's first case: peaks on a gentle line up to 10, while 11, 12, 24 and 47 ran out of
    memory on the 8 GiB card (a workspace the peaks do not show). It was planned 32 x 2."""
    trials = (ran(1, 1.05, warm_up=True), oom(47), oom(24), oom(12), oom(11))
    return profile((*trials, ran(6, 1.6), ran(8, 1.8), ran(10, 2.0)), 8)


def issue_second_case() -> Profile:
    """Readings that fall and then rise (100: 6.0, 150: 5.85, 200: 6.1 GiB) on a 16 GiB card where
    201 to 256 ran out of memory: their line is almost flat, so the max was predicted at 1790."""
    failed = tuple(oom(n) for n in (256, 228, 214, 207, 204, 202, 201))
    return profile(
        (ran(1, 3.0, warm_up=True), *failed, ran(100, 6.0), ran(150, 5.85), ran(200, 6.1)), 16
    )


@pytest.mark.parametrize("capacity_gib", [8, 7.9, 6, 8.2])
def test_the_issue_first_case_plans_below_the_smallest_oom(capacity_gib: float) -> None:
    result = plan(
        issue_first_case(), effective_batch_size=64, capacity_bytes=round(capacity_gib * GIB)
    )

    assert result.max_micro_batch_size <= 10
    assert max(result.micro_batch_sizes) < 11
    assert sum(result.micro_batch_sizes) == 64


def test_the_issue_second_case_plans_below_the_smallest_oom() -> None:
    result = plan(issue_second_case(), effective_batch_size=4096, capacity_bytes=16 * GIB)

    assert result.max_micro_batch_size <= 200
    assert result.micro_batch_size <= 200
    assert result.micro_batch_size * result.gradient_accumulation_steps == 4096


def test_every_world_size_row_stays_below_the_smallest_oom() -> None:
    rows = plan_world_sizes(
        issue_first_case(), effective_batch_size=64, world_sizes=[1, 2], capacity_bytes=8 * GIB
    )
    assert all(row.plan is not None and row.plan.micro_batch_size <= 10 for row in rows)


def test_a_larger_card_may_still_be_predicted_past_the_oom() -> None:
    # 32 GiB is four times the card the step ran out of memory on: the failure says nothing there.
    result = plan(issue_first_case(), effective_batch_size=256, capacity_bytes=32 * GIB)

    assert result.source == "predicted"
    assert result.max_micro_batch_size > 47


def test_a_plan_without_a_capacity_respects_a_failure_below_the_recommendation() -> None:
    # A profile sent by a client whose recommendation is above a size that ran out of memory.
    trials = (ran(1, 1.0, warm_up=True), oom(9), ran(4, 1.4), ran(16, 2.6))
    odd = profile(trials, 8, memory_model=MemoryModel(fixed_bytes=GIB, bytes_per_sample=GIB // 10))

    result = plan(odd, effective_batch_size=32)

    assert result.micro_batch_size <= 8


def test_a_failure_other_than_memory_bounds_every_capacity() -> None:
    # A launch limit at 12 does not move with the card's memory.
    trials = (
        ran(1, 1.05, warm_up=True),
        Trial(micro_batch_size=12, fits=False, error="RuntimeError: invalid configuration"),
        ran(6, 1.6),
        ran(8, 1.8),
        ran(11, 2.1),
    )
    failed = profile(trials, 8, failed_micro_batch_size=12, stop_kind="failure")

    for capacity in (8 * GIB, 64 * GIB):
        result = plan(failed, effective_batch_size=64, capacity_bytes=capacity)
        assert result.max_micro_batch_size <= 11


@pytest.mark.parametrize(("stop_kind", "bounded"), [("boundary", True), ("limit", False)])
def test_a_measured_maximum_bounds_every_smaller_card(stop_kind: str, bounded: bool) -> None:
    # A line of 4 GiB + 0.5 GiB a sample that puts 150 within 79 GiB, but the search found its
    # boundary at 64 (65 did not fit): a 48 GiB card is planned no further than 64, whatever the
    # line says; a capped search (a lower bound) bounds nothing.
    trials = (ran(1, 4.5, warm_up=True), ran(32, 20.0), ran(64, 36.0))
    line = MemoryModel(fixed_bytes=4 * GIB, bytes_per_sample=GIB // 2)
    measured = profile(trials, 79, memory_model=line, stop_kind=stop_kind)

    for capacity_gib in (48, 79):
        result = plan(measured, effective_batch_size=1024, capacity_bytes=capacity_gib * GIB)
        assert (result.max_micro_batch_size <= 64) is bounded, capacity_gib
