"""The pure search: which size to try next. Synthetic memory curves, exact answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autobatch.profile import MemoryModel
from autobatch.search import (
    Point,
    bracket,
    fit_memory_model,
    next_micro_batch_size,
    recommended_size,
)


def run_search(
    fixed: int,
    per_sample: int,
    capacity: int,
    prior: MemoryModel | None,
    *,
    limit: int = 1 << 20,
    optimizer_peak: int = 0,
) -> list[Point]:
    """Drive the search against peak(n) = max(optimizer_peak, fixed + per_sample * n); an OOM
    gives no peak, as on a real device."""
    points: list[Point] = []
    size: int | None = 1
    while size is not None:
        assert size not in {p.micro_batch_size for p in points}, "a size was tried twice"
        peak = max(optimizer_peak, fixed + per_sample * size)
        fits = peak <= capacity
        points.append(Point(micro_batch_size=size, fits=fits, peak_bytes=peak if fits else 0))
        size = next_micro_batch_size(points, capacity_bytes=capacity, limit=limit, prior=prior)
        assert len(points) < 80
    return points


def true_max(fixed: int, per_sample: int, capacity: int, limit: int = 1 << 20) -> int:
    return max(0, min(limit, (capacity - fixed) // per_sample))


@pytest.mark.parametrize(
    ("prior_error", "max_trials", "max_ooms"),
    [
        (0.0, 3, 1),  # exact prior: warm-up, the answer, one above
        (0.05, 4, 1),  # prior 5% pessimistic: one extra trial
        (-0.05, 5, 2),  # prior 5% optimistic: one miss, then a measured line
        (0.5, 4, 1),
        (-0.5, 10, 6),
        (3.0, 4, 1),
    ],
)
def test_prior_guided_search_finds_the_exact_max(
    prior_error: float, max_trials: int, max_ooms: int
) -> None:
    prior = MemoryModel(fixed_bytes=1_000, bytes_per_sample=int(100 * (1 + prior_error)))
    points = run_search(1_000, 100, 1_000_000, prior, optimizer_peak=1_500)
    assert bracket(points)[0] == true_max(1_000, 100, 1_000_000) == 9_990
    assert len(points) <= max_trials
    assert sum(not p.fits for p in points) <= max_ooms


def test_without_prior_grows_at_most_four_fold_then_uses_the_line() -> None:
    points = run_search(1_000, 100, 1_000_000, None)
    sizes = [p.micro_batch_size for p in points]
    assert sizes == [1, 2, 8, 32, 128, 512, 2048, 8192, 9990, 9991]


def test_stops_at_the_limit_and_never_below_one() -> None:
    assert bracket(run_search(0, 1, 10**9, None, limit=50))[0] == 50
    points = run_search(1_000, 100, 1_050, None)
    assert [p.micro_batch_size for p in points] == [1]  # size 1 does not fit: no size 0


@settings(max_examples=200, deadline=None)
@given(
    fixed=st.integers(0, 10**6),
    per_sample=st.integers(1, 10**5),
    capacity=st.integers(1, 10**8),
    prior_scale=st.one_of(st.none(), st.floats(0.2, 5.0)),
    limit=st.integers(1, 1 << 16),
)
def test_property_always_finds_the_exact_max(
    fixed: int, per_sample: int, capacity: int, prior_scale: float | None, limit: int
) -> None:
    prior = None
    if prior_scale is not None:
        prior = MemoryModel(
            fixed_bytes=fixed, bytes_per_sample=max(1, int(per_sample * prior_scale))
        )
    points = run_search(fixed, per_sample, capacity, prior, limit=limit)
    expected = true_max(fixed, per_sample, capacity, limit)
    assert bracket(points)[0] == expected
    # never more than ~3x a plain bisection of the whole range, plus the growth phase
    assert len(points) <= 3 * limit.bit_length() + 12


def test_secant_through_the_two_latest_measured_points() -> None:
    points = [
        Point(micro_batch_size=10, fits=True, peak_bytes=2_000),
        Point(micro_batch_size=20, fits=True, peak_bytes=3_000),
    ]
    model = fit_memory_model(points, prior=None)
    assert model == MemoryModel(fixed_bytes=1_000, bytes_per_sample=100)


def test_prior_slope_is_anchored_on_a_measured_point() -> None:
    prior = MemoryModel(fixed_bytes=0, bytes_per_sample=50)
    model = fit_memory_model([Point(micro_batch_size=8, fits=True, peak_bytes=1_000)], prior)
    assert model == MemoryModel(fixed_bytes=600, bytes_per_sample=50)
    assert fit_memory_model([Point(micro_batch_size=1, fits=True)], prior) == prior
    assert fit_memory_model([Point(micro_batch_size=1, fits=True)], None) is None


def test_recommended_size_keeps_the_margin() -> None:
    points = [
        Point(micro_batch_size=1, fits=True, peak_bytes=1_100),
        Point(micro_batch_size=90, fits=True, peak_bytes=10_000),
        Point(micro_batch_size=91, fits=False),
    ]
    line = MemoryModel(fixed_bytes=1_000, bytes_per_sample=100)
    # 10% of 10_000 kept free: peak <= 9_000 -> n <= 80
    assert recommended_size(points, capacity_bytes=10_000, safety_margin=0.1, model=line) == 80
    assert recommended_size(points, capacity_bytes=10_000, safety_margin=0.0, model=line) == 90
    assert recommended_size(points, capacity_bytes=10_000, safety_margin=0.99, model=line) == 1
