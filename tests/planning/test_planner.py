"""Tests for the planner (autobatch.planning's plan_request and plan_table, through the keyword
fields autobatch.plan takes): table-driven cases, errors, profiles, step times, properties."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import (
    MAX_GRADIENT_ACCUMULATION_STEPS,
    Plan,
    PlanRequest,
    PlanSource,
    WorldSizeOption,
    plan_request,
    plan_table,
)
from autobatch.planning._prediction import EXTRAPOLATION_GROWTH, Prediction
from autobatch.profile import MemoryModel, Profile, StepIdentity, Trial

GIB = 2**30
MIB = 2**20
LARGEST_PRIME_BELOW_1E9 = 999_999_937


def plan(
    limit: int | Profile | MemoryModel, *, source: PlanSource | None = None, **fields: Any
) -> Plan:
    """The pure planner from keyword fields: :func:`autobatch.plan` without its check of this
    process (the request built as it builds it, errors in its order)."""
    request = PlanRequest.for_limit(limit, source=source, **fields)
    return plan_request(limit, request, source=source)


def plan_world_sizes(
    limit: int | Profile | MemoryModel, *, source: PlanSource | None = None, **fields: Any
) -> list[WorldSizeOption]:
    """:func:`autobatch.plan_world_sizes` from keyword fields, as :func:`plan`."""
    return plan_table(limit, PlanRequest.for_limit(limit, source=source, **fields), source=source)


def assert_invariant(result: Plan, *, max_micro_batch_size: int, multiple_of: int = 1) -> None:
    sizes = result.micro_batch_sizes
    assert sum(sizes) * result.world_size == result.effective_batch_size
    assert len(sizes) == result.gradient_accumulation_steps
    assert result.micro_batch_size == max(sizes) <= max_micro_batch_size
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)
    assert all(size % multiple_of == 0 for size in sizes)
    assert result.exact == (result.effective_batch_size == result.requested_effective_batch_size)


# (max micro-batch M, effective E, world W, options, expected micro_batch_sizes)
CASES: list[tuple[int, int, int, dict[str, Any], tuple[int, ...]]] = [
    # The field case: fewest steps with equal sizes, never 24 x 2 = 48 or 24 x 3 = 72.
    (24, 64, 1, {}, (16,) * 4),
    (24, 48, 1, {}, (24, 24)),
    (24, 96, 4, {}, (24,)),
    (24, 192, 8, {}, (24,)),
    (24, 64, 2, {}, (16, 16)),
    (8, 8, 8, {}, (1,)),  # E == W
    (1, 5, 1, {}, (1,) * 5),
    (24, 1, 1, {}, (1,)),
    # E prime: unequal sizes with the minimal k = ceil(97 / 24) = 5.
    (24, 97, 1, {}, (20, 20, 19, 19, 19)),
    (24, 582, 6, {}, (20, 20, 19, 19, 19)),  # 97 per rank
    (24, 97, 1, {"uneven": "never"}, (1,) * 97),
    (24, 97, 1, {"uneven": "always"}, (20, 20, 19, 19, 19)),
    (24, 64, 1, {"uneven": "always"}, (22, 21, 21)),
    (24, 94, 1, {}, (24, 24, 23, 23)),  # 94 = 2 * 47: equal needs k = 47
    # The "auto" boundary: equal unless its k > 2 * ceil(P / M).
    (8, 9, 1, {}, (3, 3, 3)),  # equal k = 3 <= 2 * 2
    (8, 27, 1, {}, (7, 7, 7, 6)),  # equal k = 9 > 2 * 4
    # Huge E.
    (10**6, 10**9, 8, {}, (10**6,) * 125),
    (10**5, 10**9, 1, {}, (10**5,) * 10**4),
    (10**6, LARGEST_PRIME_BELOW_1E9, 1, {}, (10**6,) * 937 + (999_999,) * 63),
    # multiple_of.
    (24, 64, 1, {"multiple_of": 8}, (16,) * 4),
    (20, 64, 1, {"multiple_of": 8}, (16,) * 4),
    (24, 96, 1, {"multiple_of": 8}, (24,) * 4),
    (24, 120, 1, {"multiple_of": 8}, (24,) * 5),
    (24, 40, 1, {"multiple_of": 8}, (8,) * 5),  # 20 is not a multiple of 8
    (10, 200, 1, {"multiple_of": 8}, (8,) * 25),  # M < sqrt(200): 10 divides, 8 is needed
    # max_gradient_accumulation_steps.
    (24, 97, 1, {"max_gradient_accumulation_steps": 5}, (20, 20, 19, 19, 19)),
    (24, 96, 1, {"max_gradient_accumulation_steps": 4}, (24,) * 4),
    (24, 26, 1, {"max_gradient_accumulation_steps": 2, "uneven": "never"}, (13, 13)),
]


@pytest.mark.parametrize(("limit", "effective", "world_size", "options", "expected"), CASES)
def test_plan_table(
    limit: int,
    effective: int,
    world_size: int,
    options: dict[str, Any],
    expected: tuple[int, ...],
) -> None:
    result = plan(limit, effective_batch_size=effective, world_size=world_size, **options)

    assert result.micro_batch_sizes == expected
    assert result.micro_batch_size == expected[0]
    assert result.gradient_accumulation_steps == len(expected)
    assert result.effective_batch_size == effective == result.requested_effective_batch_size
    assert result.exact
    assert result.max_micro_batch_size == limit
    assert result.source == "given"
    assert_invariant(result, max_micro_batch_size=limit, multiple_of=options.get("multiple_of", 1))


def test_unequal_plan_says_how_to_weight_losses() -> None:
    result = plan(24, effective_batch_size=97)

    assert result.uneven
    assert any("2 of 20, 3 of 19" in note and "size / 97" in note for note in result.notes)
    assert not plan(24, effective_batch_size=64).uneven


def test_huge_effective_batch_is_fast() -> None:
    import time

    # This process's CPU time (about 2 ms here), so other processes on a loaded machine do not
    # count against the bound.
    start = time.process_time()
    result = plan(10**6, effective_batch_size=LARGEST_PRIME_BELOW_1E9 - 1, world_size=2)
    elapsed = time.process_time() - start

    assert_invariant(result, max_micro_batch_size=10**6)
    assert elapsed < 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"effective_batch_size": 100, "world_size": 3},
            ConfigError,
            "effective_batch_size 100 is not a multiple of world_size 3; use "
            "effective_batch_size=99 or 102, or allow_inexact=True (plan the nearest)",
        ),
        (
            {"effective_batch_size": 2, "world_size": 4},
            ConfigError,
            "effective_batch_size 2 is less than world_size 4",
        ),
        ({"effective_batch_size": 0}, ConfigError, "effective_batch_size 0 must be an int >= 1"),
        ({"effective_batch_size": -8}, ConfigError, "effective_batch_size -8 must be an int"),
        ({"effective_batch_size": True}, ConfigError, "effective_batch_size True must be an int"),
        ({"effective_batch_size": 64.0}, ConfigError, "effective_batch_size 64.0 must be an int"),
        ({"effective_batch_size": 64, "world_size": 0}, ConfigError, "world_size 0 must be"),
        ({"effective_batch_size": 64, "world_size": True}, ConfigError, "world_size True must"),
        ({"effective_batch_size": 64, "multiple_of": 0}, ConfigError, "multiple_of 0 must be"),
        ({"effective_batch_size": 64, "multiple_of": True}, ConfigError, "multiple_of True must"),
        (
            {"effective_batch_size": 64, "max_gradient_accumulation_steps": 0},
            ConfigError,
            "max_gradient_accumulation_steps 0 must be an int >= 1",
        ),
        ({"effective_batch_size": 64, "uneven": "sometimes"}, ConfigError, "uneven 'sometimes'"),
        ({"effective_batch_size": 64, "allow_inexact": 1}, ConfigError, "allow_inexact 1 must"),
        (
            {"effective_batch_size": 64, "uneven": "always", "multiple_of": 8},
            ConfigError,
            "uneven 'always' cannot hold with multiple_of 8",
        ),
        (
            {"effective_batch_size": 64, "capacity_bytes": 80 * GIB},
            ConfigError,
            "capacity_bytes and safety_margin need a Profile",
        ),
        (
            {"effective_batch_size": 100, "multiple_of": 8},
            NoFeasiblePlanError,
            "nearest reachable effective_batch_size: 96 below, 104 above",
        ),
        (
            {"effective_batch_size": 97, "max_gradient_accumulation_steps": 4},
            NoFeasiblePlanError,
            "at most 4 accumulation steps; nearest reachable effective_batch_size: 96 below, none",
        ),
        (
            {"effective_batch_size": 97, "max_gradient_accumulation_steps": 10, "uneven": "never"},
            NoFeasiblePlanError,
            "96 below, 98 above",  # 98 = 7 x 14
        ),
        (
            {"effective_batch_size": 64, "multiple_of": 32},
            NoFeasiblePlanError,
            "multiple_of 32 exceeds the max micro-batch size 24",
        ),
        (
            {"effective_batch_size": 100, "world_size": 3, "multiple_of": 8},
            ConfigError,
            "not a multiple of world_size 3; use effective_batch_size=96 or 120",  # per rank 32, 40
        ),
    ],
)
def test_plan_errors(kwargs: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=re.escape(pattern)):
        plan(24, **kwargs)


@pytest.mark.parametrize("limit", [0, -3, True, 2.5])
def test_bad_limit(limit: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"max micro-batch size (limit) {limit!r}")):
        plan(limit, effective_batch_size=64)


@pytest.mark.parametrize(
    ("effective", "world_size", "options", "expected_effective", "expected_sizes"),
    [
        (100, 1, {"multiple_of": 8}, 96, (24,) * 4),  # 96 and 104 tie: below wins
        (97, 1, {"max_gradient_accumulation_steps": 4}, 96, (24,) * 4),
        (100, 3, {}, 99, (11, 11, 11)),  # 33 per rank; 102 is farther
        (101, 3, {}, 102, (17,) * 2),
        (1000, 1, {"max_gradient_accumulation_steps": 2, "uneven": "never"}, 48, (24, 24)),
    ],
)
def test_allow_inexact_plans_the_nearest(
    effective: int,
    world_size: int,
    options: dict[str, Any],
    expected_effective: int,
    expected_sizes: tuple[int, ...],
) -> None:
    result = plan(
        24,
        effective_batch_size=effective,
        world_size=world_size,
        allow_inexact=True,
        **options,
    )

    assert not result.exact
    assert result.requested_effective_batch_size == effective
    assert result.effective_batch_size == expected_effective
    assert result.micro_batch_sizes == expected_sizes
    assert any(f"planned the nearest, {expected_effective}" in note for note in result.notes)
    assert_invariant(result, max_micro_batch_size=24, multiple_of=options.get("multiple_of", 1))


def test_allow_inexact_keeps_exact_plans_exact() -> None:
    assert plan(24, effective_batch_size=64, allow_inexact=True).exact


# --- profiles ------------------------------------------------------------------------------------

MODEL = MemoryModel(fixed_bytes=1 * GIB, bytes_per_sample=100 * MIB)


def make_profile(**overrides: Any) -> Profile:
    """A probe of a 1 GiB + 100 MiB/sample step on a device with 8 GiB usable."""
    fields: dict[str, Any] = {
        "max_micro_batch_size": 71,
        "recommended_micro_batch_size": 67,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (
            Trial(micro_batch_size=16, fits=True, peak_reserved_bytes=MODEL.peak_bytes(16)),
            Trial(micro_batch_size=64, fits=True, peak_reserved_bytes=MODEL.peak_bytes(64)),
            Trial(micro_batch_size=80, fits=False, oom=True),
        ),
        "num_steps": 5,
        "device_name": "sim",
        "device_type": "sim",
        "total_memory_bytes": 8 * GIB,
        "capacity_bytes": 8 * GIB,
        "memory_model": MODEL,
    }
    fields.update(overrides)
    identity = {k: fields.pop(k) for k in list(fields) if k in StepIdentity.__dataclass_fields__}
    return Profile(**fields, identity=StepIdentity(**identity))


def test_profile_uses_recommended_size_and_models_the_peak() -> None:
    result = plan(make_profile(), effective_batch_size=128)

    assert result.max_micro_batch_size == 67
    assert result.micro_batch_sizes == (64, 64)
    assert result.source == "measured"
    assert result.predicted_peak_memory_bytes == MODEL.peak_bytes(64)  # measured at 64
    assert result.capacity_bytes == 8 * GIB
    assert result.headroom_bytes == 8 * GIB - MODEL.peak_bytes(64)
    assert result.predicted_seconds_per_effective_batch is None


def test_profile_between_measured_sizes_interpolates_the_measured_peaks() -> None:
    trials = (
        Trial(micro_batch_size=16, fits=True, peak_reserved_bytes=2_800_000_000),
        Trial(micro_batch_size=64, fits=True, peak_reserved_bytes=7_900_000_000),
    )
    result = plan(make_profile(trials=trials), effective_batch_size=120)  # 60 x 2

    assert result.micro_batch_sizes == (60, 60)
    # 2.8e9 at 16 and 7.9e9 at 64 measured: 2.8e9 + 5.1e9 * 44 / 48 at 60, not the stored line.
    assert result.predicted_peak_memory_bytes == 7_475_000_000
    assert result.headroom_bytes == 8 * GIB - 7_475_000_000
    assert result.source == "measured"
    assert result.prediction is None


def test_estimated_profile_is_marked_estimated() -> None:
    assert plan(make_profile(method="estimate"), effective_batch_size=64).source == "estimated"


def raised_line_bytes(size: int, *, largest: int = 64) -> float:
    """MODEL's peak at ``size`` raised by the extrapolation margin rule (12.5% per ``largest``)."""
    return MODEL.peak_bytes(size) * (1 + EXTRAPOLATION_GROWTH * (size - largest) / largest)


def test_profile_on_another_capacity_is_predicted_with_a_growing_margin() -> None:
    capacity_bytes = 80 * GIB
    budget = int(capacity_bytes * 0.95)
    result = plan(make_profile(), effective_batch_size=1024, capacity_bytes=capacity_bytes)

    # The bare line would allow (76 GiB - 1 GiB) // 100 MiB = 768; the margin rule allows 438.
    assert result.max_micro_batch_size == 438
    assert raised_line_bytes(438) <= budget < raised_line_bytes(439)
    assert result.micro_batch_sizes == (256,) * 4
    assert result.capacity_bytes == capacity_bytes
    assert result.predicted_peak_memory_bytes == MODEL.peak_bytes(256)
    assert result.headroom_bytes == capacity_bytes - MODEL.peak_bytes(256)
    assert result.source == "predicted"
    assert result.prediction == Prediction(
        largest_measured_micro_batch_size=64,
        num_fit_points=2,
        fit_residual_bytes=0,
        fixed_bytes=MODEL.fixed_bytes,
        bytes_per_sample=MODEL.bytes_per_sample,
        margin=EXTRAPOLATION_GROWTH * (438 - 64) / 64,
    )
    assert any("438 is predicted, not measured" in note for note in result.notes)
    assert any("largest that really ran is 64" in note for note in result.notes)


def test_profile_on_another_capacity_with_own_margin() -> None:
    # int(16 GiB * 0.5) = 8 GiB usable: the line allows 71, raised by 12.5% * 7 / 64 it does not.
    result = plan(
        make_profile(), effective_batch_size=70, capacity_bytes=16 * GIB, safety_margin=0.5
    )

    assert raised_line_bytes(70) <= 8 * GIB < raised_line_bytes(71)
    assert result.max_micro_batch_size == 70
    assert result.micro_batch_sizes == (70,)
    assert result.source == "predicted"


def test_profile_with_a_new_margin_on_the_same_device() -> None:
    # int(8 GiB * 0.5) = 4 GiB usable; (4 GiB - 1 GiB) // 100 MiB = 30.
    result = plan(make_profile(), effective_batch_size=60, safety_margin=0.5)

    assert result.max_micro_batch_size == 30
    assert result.micro_batch_sizes == (30, 30)


def test_profile_that_cannot_fit_the_other_capacity() -> None:
    # 1 GiB + 100 MiB needed at micro-batch 1, in the bytes a reader reads.
    with pytest.raises(
        NoFeasiblePlanError,
        match=re.escape(
            f"needs 1.10 GiB ({GIB + 100 * MIB} bytes) at micro-batch size 1, more than the "
            "972.80 MiB usable of "
            f"capacity_bytes {GIB} with safety_margin 0.05"
        ),
    ):
        plan(make_profile(), effective_batch_size=64, capacity_bytes=1 * GIB)


def test_profile_without_memory_model_cannot_predict_other_capacity() -> None:
    trials = (Trial(micro_batch_size=71, fits=True), Trial(micro_batch_size=80, fits=False))
    profile = make_profile(memory_model=None, trials=trials)
    with pytest.raises(ConfigError, match="no measured peaks and no memory model"):
        plan(profile, effective_batch_size=64, capacity_bytes=80 * GIB)
    with pytest.raises(ConfigError, match="no memory model to re-derive"):
        plan(profile, effective_batch_size=64, safety_margin=0.2)


@pytest.mark.parametrize("margin", [-0.1, 1.0, True])
def test_profile_bad_safety_margin(margin: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"safety_margin {margin!r} must be")):
        plan(make_profile(), effective_batch_size=64, safety_margin=margin)


def test_profile_bad_capacity() -> None:
    with pytest.raises(ConfigError, match="capacity_bytes 0 must be an int >= 1"):
        plan(make_profile(), effective_batch_size=64, capacity_bytes=0)


# --- step times ----------------------------------------------------------------------------------


def test_step_times_prefer_a_faster_smaller_micro_batch() -> None:
    # 24 slows down near the memory limit: 2 x 24 = 1.0 s, 3 x 16 = 0.48 s, 6 x 8 = 0.48 s.
    result = plan(24, effective_batch_size=48, step_seconds={8: 0.08, 16: 0.16, 24: 0.5})

    assert result.micro_batch_sizes == (16, 16, 16)  # ties with 6 x 8 go to fewer steps
    assert result.predicted_seconds_per_effective_batch == pytest.approx(0.48)
    assert any("chose 3 steps of 16 over 2 of 24" in note for note in result.notes)


def test_linear_step_times_keep_the_fewest_steps_and_predict_time() -> None:
    # t(m) = 0.02 + 0.01 m: k steps cost 0.02 k + 0.64 s.
    result = plan(24, effective_batch_size=64, step_seconds={8: 0.10, 16: 0.18})

    assert result.micro_batch_sizes == (16,) * 4
    assert result.predicted_seconds_per_effective_batch == pytest.approx(0.72)
    assert result.notes == ()


def test_step_times_predict_unequal_micro_batches() -> None:
    result = plan(24, effective_batch_size=97, step_seconds={10: 0.12, 20: 0.22})

    # 2 x t(20) + 3 x t(19) = 2 x 0.22 + 3 x 0.21
    assert result.predicted_seconds_per_effective_batch == pytest.approx(1.07)


def test_step_times_extrapolate_without_going_negative() -> None:
    # Below the smallest measured size the time is kept >= the per-sample time at that size.
    result = plan(24, effective_batch_size=4, step_seconds={16: 0.16, 24: 0.5})

    assert result.micro_batch_sizes == (4,)
    assert result.predicted_seconds_per_effective_batch == pytest.approx(0.04)


def timed_profile(timings: dict[int, tuple[float, ...]], **overrides: Any) -> Profile:
    """A profile whose fitting trials at each size took ``timings`` seconds (a repeat trial for
    each timing after the first), with a warm-up at 1 and an OOM above the largest size."""
    trials = [
        Trial(
            micro_batch_size=1,
            fits=True,
            peak_reserved_bytes=GIB,
            warm_up=True,
            step_seconds=0.0001,
        )
    ]
    for size, times in sorted(timings.items()):
        peak = GIB + size * 100 * 2**20
        trials.extend(
            Trial(
                micro_batch_size=size,
                fits=True,
                peak_reserved_bytes=peak,
                step_seconds=t,
                repeat=i > 0,
            )
            for i, t in enumerate(times)
        )
    largest = max(timings)
    trials.append(Trial(micro_batch_size=largest + 1, fits=False, oom=True))
    fields: dict[str, Any] = {
        "max_micro_batch_size": largest,
        "recommended_micro_batch_size": largest,
        "trials": tuple(trials),
    }
    return make_profile(**{**fields, **overrides})


def test_profile_step_times_timed_once_keep_the_fewest_steps() -> None:
    # Each size timed once: 3 x 16 predicts 0.48 s against 2 x 24's 1.0 s, but one timing per
    # size cannot tell that from noise (the E=256 case chose 1 x 256 by such numbers).
    profile = timed_profile({8: (0.08,), 16: (0.16,), 24: (0.5,)})

    same_device = plan(profile, effective_batch_size=48)
    other_device = plan(profile, effective_batch_size=48, capacity_bytes=80 * GIB)

    assert same_device.micro_batch_sizes == (24, 24)
    assert same_device.predicted_seconds_per_effective_batch == pytest.approx(1.0)
    (note,) = [n for n in same_device.notes if n.startswith("kept 2 steps of 24")]
    assert "predict 3 steps of 16 faster (0.48 s vs 1 s" in note
    assert "micro-batch 16: 0.16 s; micro-batch 24: 0.5 s" in note
    assert other_device.predicted_seconds_per_effective_batch is None


def test_profile_step_times_timed_twice_apart_choose_by_throughput_and_show_the_timings() -> None:
    profile = timed_profile({8: (0.08,), 16: (0.16, 0.17), 24: (0.5, 0.52)})

    result = plan(profile, effective_batch_size=48)

    assert result.micro_batch_sizes == (16, 16, 16)
    assert result.predicted_seconds_per_effective_batch == pytest.approx(3 * 0.165)
    (note,) = [n for n in result.notes if n.startswith("chose 3 steps of 16 over 2 of 24")]
    assert "micro-batch 16: 0.16, 0.17 s; micro-batch 24: 0.5, 0.52 s" in note


def test_profile_step_times_within_their_spread_keep_the_fewest_steps() -> None:
    # 3 x 16 from its slowest timing (3 x 0.4 = 1.2 s) is not below 2 x 24 from its fastest
    # (2 x 0.45 = 0.9 s): the difference of the means is inside the spread.
    profile = timed_profile({16: (0.1, 0.4), 24: (0.45, 0.55)})

    result = plan(profile, effective_batch_size=48)

    assert result.micro_batch_sizes == (24, 24)
    assert any(n.startswith("kept 2 steps of 24") for n in result.notes)


def test_a_noisy_tiny_model_plans_the_same_in_every_run() -> None:
    # The E=256 case: a tiny model whose only timings are one trial at 1 and the chosen
    # size timed twice on a loaded machine; whatever the noise, the plan is 1 x 256.
    plans = {
        plan(
            timed_profile(
                {1: (t1,), 256: (t256, t256 * noise)},
                total_memory_bytes=64 * GIB,
                capacity_bytes=64 * GIB,
            ),
            effective_batch_size=256,
        ).micro_batch_sizes
        for t1 in (0.0019, 0.004, 0.0005)
        for t256 in (1.03, 0.3)
        for noise in (1.0, 1.5)
    }
    assert plans == {(256,)}


@pytest.mark.parametrize(
    ("step_seconds", "pattern"),
    [
        ({8: 0.1}, "needs step times at two sizes or more"),
        ({8: 0.1, 16: -0.2}, "step_seconds[16] -0.2 must be finite seconds > 0"),
        ({8: 0.1, 16: math.nan}, "step_seconds[16] nan must be finite"),
        ({8: 0.1, 16: True}, "step_seconds[16] True must be finite"),
        ({0: 0.1, 16: 0.2}, "step_seconds micro-batch size 0 must be an int >= 1"),
    ],
)
def test_bad_step_seconds(step_seconds: dict[int, float], pattern: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(pattern)):
        plan(24, effective_batch_size=64, step_seconds=step_seconds)


# --- the Plan dataclass --------------------------------------------------------------------------


def test_plan_round_trips_through_json() -> None:
    result = plan(make_profile(), effective_batch_size=97, allow_inexact=True)
    data = json.loads(json.dumps(result.to_dict()))

    assert data["micro_batch_sizes"] == [49, 48]
    assert Plan.from_dict(data) == result


def make_plan_fields(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 4,
        "world_size": 2,
        "effective_batch_size": 128,
        "requested_effective_batch_size": 128,
        "micro_batch_sizes": (16, 16, 16, 16),
        "exact": True,
        "max_micro_batch_size": 24,
    }
    fields.update(overrides)
    return fields


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"effective_batch_size": 100, "exact": False}, "breaks the batch invariant"),
        ({"gradient_accumulation_steps": 3}, "4 micro_batch_sizes but gradient_accumulation_steps"),
        ({"micro_batch_sizes": (17, 16, 16, 15)}, "differ by at most 1"),
        ({"micro_batch_sizes": (16, 17, 16, 15)}, "non-increasing"),
        ({"micro_batch_size": 24}, "must be the largest of micro_batch_sizes"),
        ({"max_micro_batch_size": 8}, "exceeds max_micro_batch_size 8"),
        ({"exact": False}, "exact=False contradicts"),
        ({"world_size": 0}, "world_size >= 1"),
        ({"source": "guessed"}, "plan source 'guessed'"),
    ],
)
def test_plan_rejects_inconsistent_fields(overrides: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(pattern)):
        Plan(**make_plan_fields(**overrides))


def test_plan_from_dict_rejects_unknown_and_missing_fields() -> None:
    data = Plan(**make_plan_fields()).to_dict()
    with pytest.raises(ConfigError, match=re.escape("unknown fields ['batch_size']")):
        Plan.from_dict({**data, "batch_size": 32})
    del data["exact"]
    with pytest.raises(ConfigError, match="not a valid plan"):
        Plan.from_dict(data)


# --- world sizes ---------------------------------------------------------------------------------


def test_plan_world_sizes_table() -> None:
    rows = plan_world_sizes(24, effective_batch_size=96, world_sizes=[1, 2, 3, 5, 8, 128])

    assert [row.world_size for row in rows] == [1, 2, 3, 5, 8, 128]
    sizes = [None if row.plan is None else row.plan.micro_batch_sizes for row in rows]
    assert sizes == [(24,) * 4, (24, 24), (16, 16), None, (12,), None]
    assert rows[3].reason == "effective_batch_size 96 is not a multiple of world_size 5"
    assert "; use effective_batch_size=95 or 100, or allow_inexact=True" in rows[3].describe()
    assert "less than world_size 128" in rows[5].reason
    assert rows[0].reason == ""
    for row in rows:
        if row.plan is not None:
            assert row.plan.world_size == row.world_size
            assert_invariant(row.plan, max_micro_batch_size=24)
    assert json.loads(json.dumps(rows[3].to_dict())) == {
        "world_size": 5,
        "plan": None,
        "reason": rows[3].describe(),  # with its remedies, in Python's terms
    }


def test_plan_world_sizes_with_profile_and_inexact() -> None:
    rows = plan_world_sizes(
        make_profile(), effective_batch_size=1000, world_sizes=[1, 3], allow_inexact=True
    )

    assert [row.plan.effective_batch_size if row.plan else None for row in rows] == [1000, 999]
    assert rows[1].plan is not None and not rows[1].plan.exact


def test_plan_world_sizes_raises_for_errors_no_world_size_fixes() -> None:
    with pytest.raises(ConfigError, match="world_size 0 must be an int >= 1"):
        plan_world_sizes(24, effective_batch_size=96, world_sizes=[1, 0])
    with pytest.raises(ConfigError, match="multiple_of 0 must be"):
        plan_world_sizes(24, effective_batch_size=96, world_sizes=[1], multiple_of=0)
    with pytest.raises(NoFeasiblePlanError, match="at micro-batch size 1"):
        plan_world_sizes(
            make_profile(), effective_batch_size=96, world_sizes=[1], capacity_bytes=GIB
        )


def test_world_size_option_needs_plan_or_reason() -> None:
    with pytest.raises(ConfigError, match="either a plan or a reason"):
        WorldSizeOption(world_size=2, plan=None)


# --- properties against a brute-force reference --------------------------------------------------


def reference_steps(
    per_rank: int, limit: int, multiple_of: int, max_steps: int | None, uneven: str
) -> int | None:
    """The documented rule, by brute force over every k (slow, small inputs only)."""
    top = per_rank if max_steps is None else min(per_rank, max_steps)
    equal = [
        k
        for k in range(1, top + 1)
        if per_rank % k == 0 and per_rank // k <= limit and (per_rank // k) % multiple_of == 0
    ]
    minimal = next((k for k in range(1, top + 1) if math.ceil(per_rank / k) <= limit), None)
    if multiple_of > 1 or uneven == "never":
        minimal = None
    if uneven == "always":
        return minimal
    if minimal is None or (equal and equal[0] <= 2 * minimal):
        return equal[0] if equal else None
    return minimal


def reference_reachable(
    effective: int,
    world_size: int,
    limit: int,
    multiple_of: int,
    max_steps: int | None,
    uneven: str,
) -> bool:
    if effective % world_size:
        return False
    steps = reference_steps(effective // world_size, limit, multiple_of, max_steps, uneven)
    return steps is not None


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 40),
    effective=st.integers(1, 400),
    world_size=st.integers(1, 8),
    multiple_of=st.sampled_from([1, 1, 2, 8]),
    max_steps=st.one_of(st.none(), st.integers(1, 12)),
    uneven=st.sampled_from(["auto", "never", "always"]),
)
def test_plan_matches_brute_force_reference(
    limit: int,
    effective: int,
    world_size: int,
    multiple_of: int,
    max_steps: int | None,
    uneven: Any,
) -> None:
    if uneven == "always" and multiple_of > 1:
        return
    options: dict[str, Any] = {
        "world_size": world_size,
        "multiple_of": multiple_of,
        "max_gradient_accumulation_steps": max_steps,
        "uneven": uneven,
    }
    args = (limit, multiple_of, max_steps, uneven)
    try:
        result = plan(limit, effective_batch_size=effective, **options)
    except (ConfigError, NoFeasiblePlanError) as exc:
        assert not reference_reachable(effective, world_size, *args)
        if effective < world_size or multiple_of > limit:
            return

        # The named nearest values are the nearest reachable ones, by brute force.
        def ok(e: int) -> bool:
            return reference_reachable(e, world_size, *args)

        below = next((e for e in range(effective - 1, world_size - 1, -1) if ok(e)), None)
        top = 4 * effective + 2000 if max_steps is None else limit * max_steps * world_size
        above = next((e for e in range(effective + 1, top + 1) if ok(e)), None)
        message = str(exc)
        if isinstance(exc, NoFeasiblePlanError):
            assert f"{below if below is not None else 'none'} below" in message
            assert f"{above if above is not None else 'none'} above" in message
        else:
            nearest = tuple(v for v in (below, above) if v is not None)
            named = [r.values for r in exc.remedies if r.parameter == "effective_batch_size"]
            assert named == ([nearest] if nearest else [])
        return
    assert reference_reachable(effective, world_size, *args)
    expected = reference_steps(effective // world_size, *args)
    assert result.gradient_accumulation_steps == expected
    assert_invariant(result, max_micro_batch_size=limit, multiple_of=multiple_of)
    assert result.exact


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(1, 10**6),
    per_rank=st.integers(1, 10**9),
    world_size=st.integers(1, 64),
    multiple_of=st.sampled_from([1, 1, 8]),
    # Bounded: micro_batch_sizes holds one entry per step, and equal splits of a prime need
    # as many steps as samples.
    max_steps=st.integers(1, 10**4),
    uneven=st.sampled_from(["auto", "never"]),
)
def test_invariant_holds_or_inexact_plan_is_reachable(
    limit: int,
    per_rank: int,
    world_size: int,
    multiple_of: int,
    max_steps: int,
    uneven: Any,
) -> None:
    effective = per_rank * world_size
    try:
        result = plan(
            limit,
            effective_batch_size=effective,
            world_size=world_size,
            multiple_of=multiple_of,
            max_gradient_accumulation_steps=max_steps,
            uneven=uneven,
            allow_inexact=True,
        )
    except NoFeasiblePlanError:
        assert multiple_of > limit
        return
    assert_invariant(result, max_micro_batch_size=limit, multiple_of=multiple_of)
    assert result.requested_effective_batch_size == effective
    assert result.gradient_accumulation_steps <= max_steps
    if multiple_of == 1 and uneven == "auto":
        # Unequal sizes reach every per-rank count up to M * K, and nothing above it.
        assert result.exact == (per_rank <= limit * max_steps)


# --- purity --------------------------------------------------------------------------------------


def test_planner_and_integrations_import_neither_torch_nor_pynvml() -> None:
    # Load the modules under a bare package object so the test checks their own imports, not
    # whatever autobatch/__init__.py may pull in.
    package_dir = Path(__file__).resolve().parents[2] / "autobatch"
    code = (
        "import sys, types\n"
        "package = types.ModuleType('autobatch')\n"
        f"package.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules['autobatch'] = package\n"
        "import autobatch.planning._planner, autobatch.integrations,"
        " autobatch.store\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pynvml')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )

    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("limit", "effective", "expected"),
    [
        (10**12, 10**18, (10**12, 10**6)),
        (10**18, 10**18, (10**18, 1)),
        (10**18, 10**18 + 9, (500000000000000005, 2)),
    ],
)
def test_astronomical_sizes_plan_at_once(
    limit: int, effective: int, expected: tuple[int, int]
) -> None:
    result = plan(limit, effective_batch_size=effective)
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == expected
    assert sum(result.micro_batch_sizes) == effective


def test_accumulation_steps_are_capped() -> None:
    with pytest.raises(NoFeasiblePlanError, match="at most 1048576 accumulation steps"):
        plan(1, effective_batch_size=MAX_GRADIENT_ACCUMULATION_STEPS + 1)
    result = plan(1, effective_batch_size=MAX_GRADIENT_ACCUMULATION_STEPS)
    assert result.gradient_accumulation_steps == MAX_GRADIENT_ACCUMULATION_STEPS


def test_wrong_kinds_of_table_arguments() -> None:
    with pytest.raises(ConfigError, match="must map micro-batch sizes to seconds"):
        plan(24, effective_batch_size=64, step_seconds=[1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a list of ints"):
        plan_world_sizes(24, effective_batch_size=64, world_sizes=4)  # type: ignore[arg-type]
