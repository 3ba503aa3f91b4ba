"""``mixed_limits``: each rank's limit (a profile of its own card, or one predicted for it) as a
:class:`RankLimit` with its fitted step line (shared as plain numbers), the mixed plan of every
rank, and each rank resolved here completed with its own limit (peaks, capacity, source,
prediction, budget)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from autobatch.errors import ConfigError
from autobatch.planning import (
    PlanRequest,
    RankLimit,
    StepLine,
    given_budget,
    plan_mixed_ranks,
    plan_request,
)
from autobatch.planning._planner import resolve_plan_limit
from autobatch.profile import GradientSync, Trial
from tests.planning.test_mixed import mixed
from tests.planning.test_planner import GIB, MODEL, make_profile


def _timed(size: int, seconds: float, *, warm_up: bool = False) -> Trial:
    return Trial(
        micro_batch_size=size,
        fits=True,
        peak_reserved_bytes=MODEL.peak_bytes(size),
        step_seconds=seconds,
        warm_up=warm_up,
    )


def test_rank_limit_fits_the_line_through_the_timed_trials_without_the_warm_up() -> None:
    trials = (
        _timed(1, 9.0, warm_up=True),  # creates the optimizer state: left out
        _timed(16, 0.10),
        _timed(16, 0.12),
        _timed(64, 0.31),
    )
    rank = RankLimit.of(make_profile(trials=trials), PlanRequest(effective_batch_size=64))

    assert rank.max_micro_batch_size == 67  # the profile's recommended size
    assert rank.step_line is not None
    # Through (16, 0.11) and (64, 0.31): 0.2 s per 48 rows.
    assert rank.step_line.per_sample_seconds == pytest.approx(0.2 / 48)
    assert rank.step_line.fixed_seconds == pytest.approx(0.11 - 16 * 0.2 / 48)
    shared = rank.shared()
    assert pickle.loads(pickle.dumps(shared)) == shared == rank  # what ranks exchange


def test_rank_limit_without_two_timed_sizes_has_no_line() -> None:
    rank = RankLimit.of(make_profile(), PlanRequest(effective_batch_size=64))
    assert rank == RankLimit(max_micro_batch_size=67)
    with pytest.raises(ConfigError, match="max_micro_batch_size 0 must be an int >= 1"):
        RankLimit(max_micro_batch_size=0)


def test_mixed_plans_use_lines_only_when_every_rank_has_one() -> None:
    request = PlanRequest(effective_batch_size=96, world_size=2)
    fast = StepLine(fixed_seconds=0.03, per_sample_seconds=0.004)
    slow = StepLine(fixed_seconds=0.05, per_sample_seconds=0.0065)
    timed = plan_mixed_ranks(
        [
            RankLimit(max_micro_batch_size=48, step_line=fast),
            RankLimit(max_micro_batch_size=20, step_line=slow),
        ],
        request,
    )
    assert timed[0].rank_micro_batch_sizes == (32, 16)  # two steps, by time
    assert timed[0].predicted_seconds_per_effective_batch is not None
    untimed = plan_mixed_ranks(
        [RankLimit(max_micro_batch_size=48, step_line=fast), RankLimit(max_micro_batch_size=20)],
        request,
    )
    assert untimed == mixed([48, 20], effective_batch_size=96)
    assert untimed[0].rank_micro_batch_sizes == (34, 14)
    assert untimed[0].predicted_seconds_per_effective_batch is None


@pytest.mark.parametrize(
    ("request_fields", "match"),
    [
        ({"allow_inexact": True}, "allow_inexact does not go with a mixed plan"),
        ({"world_sizes": (1, 2)}, "world_sizes does not go with a mixed plan"),
        ({"step_seconds": {8: 0.1, 16: 0.2}}, "step_seconds does not go with a mixed plan"),
        ({"world_size": 3}, "world_size 3 is not the number of ranks planned, 2"),
    ],
)
def test_the_ranks_entry_refuses_what_a_mixed_plan_does_not_do(
    request_fields: dict[str, object], match: str
) -> None:
    request = PlanRequest(**{"effective_batch_size": 96, "world_size": 2, **request_fields})
    ranks = [RankLimit(max_micro_batch_size=48), RankLimit(max_micro_batch_size=20)]
    with pytest.raises(ConfigError, match=match):
        plan_mixed_ranks(ranks, request)


def test_each_rank_resolved_here_is_completed_from_its_own_card() -> None:
    measured = make_profile(gradient_sync=GradientSync(mode="none"))
    request = PlanRequest(effective_batch_size=128, world_size=2)
    wider = dataclasses.replace(request, capacity_bytes=80 * GIB)
    own = resolve_plan_limit(measured, request, "cached")
    # The other rank's card has 80 GiB: its limit is predicted from the same profile.
    bigger = resolve_plan_limit(measured, wider, "cached")
    assert bigger.source == "predicted" and bigger.max_micro_batch_size > 67
    ranks = [
        RankLimit.of(measured, request, source="cached"),
        RankLimit.of(measured, wider, source="cached"),
    ]
    plans = plan_mixed_ranks(ranks, request)
    small, large = plans
    bare = plan_mixed_ranks([rank.shared() for rank in ranks], request)

    assert small.rank_micro_batch_sizes == large.rank_micro_batch_sizes
    assert small.micro_batch_size < large.micro_batch_size
    assert small.source == "cached" and small.prediction is None
    assert small.capacity_bytes == 8 * GIB
    assert small.predicted_peak_memory_bytes == own.peak_bytes(small.micro_batch_size)
    assert small.headroom_bytes == 8 * GIB - small.predicted_peak_memory_bytes
    assert small.gradient_sync == GradientSync(mode="none")
    assert large.source == "predicted" and large.prediction == bigger.prediction
    assert large.capacity_bytes == 80 * GIB
    assert large.gradient_sync == GradientSync(mode="none")
    assert large.notes[: len(bigger.notes)] == bigger.notes  # the limit's notes come first
    assert large.notes[len(bigger.notes) :] == bare[1].notes
    # Known by its numbers alone (another process's rank), a rank's plan is the bare split.
    assert bare[1].source == "given" and bare[1].predicted_peak_memory_bytes is None
    assert bare[1].rank_micro_batch_sizes == large.rank_micro_batch_sizes


def test_the_budget_goes_on_the_plans_of_ranks_resolved_here() -> None:
    profile = make_profile()
    request = PlanRequest(effective_batch_size=128, world_size=2)
    budget = given_budget(8 * GIB, gpu_fraction=0.5)
    mine = RankLimit.of(profile, request, source="cached")
    plans = plan_mixed_ranks([mine, mine.shared()], request, budget=budget)
    alone = plan_request(profile, request, budget=budget, source="cached")
    assert plans[0].budget is not None and alone.budget is not None
    assert plans[0].budget.budget_bytes == alone.budget.budget_bytes == 4 * GIB
    assert plans[0].budget.deciding_source == "gpu_fraction"
    assert plans[0].budget.trials_per_gpu == alone.budget.trials_per_gpu
    assert plans[1].budget is None
