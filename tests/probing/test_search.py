"""The pure search: which size to try next. Synthetic memory curves, exact answers."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autobatch.errors import ConfigError
from autobatch.probing._search import (
    DOUBLING_EXCESS,
    Point,
    bracket,
    doubling_failures,
    fit_memory_model,
    fit_wide_line,
    next_micro_batch_size,
    recommended_size,
    trial_budget,
    warm_up_line,
)
from autobatch.profile import MemoryModel


def run_search(
    fixed: int,
    per_sample: int,
    capacity: int,
    prior: MemoryModel | None,
    *,
    limit: int = 1 << 20,
    optimizer_peak: int = 0,
) -> list[Point]:
    """Drive the search against peak(n) = max(optimizer_peak, fixed + per_sample * n) after a
    warm-up at 1 (no peak, as in the probe); an OOM gives no peak, as on a real device."""
    first_fits = max(optimizer_peak, fixed + per_sample) <= capacity
    points = [Point(micro_batch_size=1, fits=first_fits, warm_up=True)]
    size = next_micro_batch_size(points, capacity_bytes=capacity, limit=limit, prior=prior)
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
        (-0.5, 6, 3),
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


def test_without_prior_the_search_from_what_ran_until_two_peaks_give_a_line() -> None:
    # before a line, the search from the warm-up (4049 under 65536: one failure there, then
    # a scan where trials are plenty); then the secant through two peaks, one above its max
    small = run_search(1_000, 100, 6_000, None, limit=65536)  # max 50
    assert [p.micro_batch_size for p in small] == [1, 4049, 155, 2, 3, 50, 51]
    large = run_search(1_000, 100, 1_000_000, None, limit=65536)  # max 9990
    assert [p.micro_batch_size for p in large] == [1, 4049, 24311, 9418, 9990, 9991]
    # fake steps (the estimate's) always finish: growth, then the line
    fake = [Point(micro_batch_size=1, fits=True, peak_bytes=1_100)]
    assert (
        next_micro_batch_size(
            fake, capacity_bytes=10**6, limit=65536, prior=None, failures_follow_peaks=True
        )
        == 4
    )


@pytest.mark.parametrize(
    ("capacity", "optimizer_peak", "sizes"),
    [
        (6_000, 0, [1, 50, 51]),  # max 50: the line is right, one above fails
        (1_000_000, 0, [1, 9990, 9991]),  # max 9990
        # the optimizer step dominates the warm-up: the line's max is low (1998, it fits), the
        # line from the resident bytes through its peak is right again
        (1_000_000, 1_500, [1, 1998, 9990, 9991]),
        (6_000, 1_500, [1, 10, 50, 51]),
    ],
)
def test_the_warm_up_s_line_keeps_a_well_behaved_model_to_one_oom(
    capacity: int, optimizer_peak: int, sizes: list[int]
) -> None:
    # Without an estimate: the line from the resident bytes (1,000) through the warm-up's peak
    # at 1 (1,100, or the optimizer step's 1,500) is the search's prior, under a limit of 65536.
    points = [Point(micro_batch_size=1, fits=True, warm_up=True)]
    line = warm_up_line(points, warm_up_peak_bytes=max(optimizer_peak, 1_100), fixed_bytes=1_000)
    assert line is not None and line.fixed_bytes == 1_000
    assert line.bytes_per_sample == (500 if optimizer_peak else 100)
    ran = run_search(1_000, 100, capacity, line, limit=65536, optimizer_peak=optimizer_peak)
    assert [p.micro_batch_size for p in ran] == sizes
    assert sum(not p.fits for p in ran) == 1
    # no line where the warm-up's peak is unknown or not above the resident bytes
    assert warm_up_line(points, warm_up_peak_bytes=0, fixed_bytes=1_000) is None
    assert warm_up_line(points, warm_up_peak_bytes=1_000, fixed_bytes=1_000) is None
    assert warm_up_line(points[:0], warm_up_peak_bytes=1_100, fixed_bytes=1_000) is None


def test_a_secant_s_max_is_exact_where_its_rounded_slope_is_not() -> None:
    # peaks 1,000 + 100.4 n: the slope rounds up to 101, whose max under 1,000,000 is 9926;
    # the two points say 9950, and one above it is the next size
    points = [
        Point(micro_batch_size=1, fits=True, warm_up=True),
        Point(micro_batch_size=1000, fits=True, peak_bytes=101_400),
        Point(micro_batch_size=6000, fits=True, peak_bytes=603_400),
    ]
    model = fit_memory_model(points, None)
    assert model is not None and model.max_micro_batch_size(1_000_000) == 9_926
    assert next_micro_batch_size(points, capacity_bytes=1_000_000, limit=65536, prior=None) == 9_951


def test_flat_peaks_leave_the_search_to_what_ran_until_a_line_forms() -> None:
    # the optimizer step dominates up to 99: 155 and 852 give the first line
    points = run_search(1_000, 100, 30_000, None, limit=65536, optimizer_peak=10_000)
    assert [p.micro_batch_size for p in points] == [1, 4049, 155, 852, 256, 290, 291]
    assert bracket(points)[0] == 290
    assert len(points) - 1 <= trial_budget(65536) == 19


@pytest.mark.parametrize("limit", [0, -3, 2.5, True])
def test_a_limit_below_one_is_refused_naming_the_value_and_the_range(limit: object) -> None:
    points = [Point(micro_batch_size=1, fits=True, warm_up=True)]
    with pytest.raises(ConfigError, match=rf"limit {limit!r} must be an int >= 1"):
        next_micro_batch_size(points, capacity_bytes=10**9, limit=limit, prior=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"limit {limit!r} must be an int >= 1"):
        trial_budget(limit)  # type: ignore[arg-type]
    assert trial_budget(1) == 3 and trial_budget(20_000) == 18


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
    assert len(points) - 1 <= trial_budget(limit)  # the warm-up aside


def test_secant_through_the_two_latest_measured_points() -> None:
    points = [
        Point(micro_batch_size=10, fits=True, peak_bytes=2_000),
        Point(micro_batch_size=20, fits=True, peak_bytes=3_000),
    ]
    model = fit_memory_model(points, prior=None)
    assert model == MemoryModel(fixed_bytes=1_000, bytes_per_sample=100)


def test_the_prior_s_fixed_bytes_are_kept_and_its_slope_replaced_by_a_measured_point() -> None:
    prior = MemoryModel(fixed_bytes=200, bytes_per_sample=50)
    measured = [Point(micro_batch_size=8, fits=True, peak_bytes=1_000)]
    assert fit_memory_model(measured, prior) == MemoryModel(fixed_bytes=200, bytes_per_sample=100)
    # a peak not above the prior's fixed bytes: the prior's slope through the point
    below = [Point(micro_batch_size=8, fits=True, peak_bytes=150)]
    assert fit_memory_model(below, prior) == MemoryModel(fixed_bytes=-250, bytes_per_sample=50)
    assert fit_memory_model([Point(micro_batch_size=1, fits=True)], prior) == prior
    assert fit_memory_model([Point(micro_batch_size=1, fits=True)], None) is None


def test_the_wide_line_is_not_tilted_by_rounding_between_adjacent_sizes() -> None:
    def peak(n: int) -> int:  # 1_000 + 300 n, rounded up to 512-byte blocks
        return -(-(1_000 + 300 * n) // 512) * 512

    points = [
        Point(micro_batch_size=n, fits=peak(n) <= 1_000_000, peak_bytes=peak(n))
        for n in (1, 64, 2000, 2001)  # 2000 and 2001 are one 512-byte block apart
    ]
    secant = fit_memory_model(points, prior=None)
    wide = fit_wide_line(points)
    assert secant is not None and wide is not None
    assert abs(wide.bytes_per_sample - 300) <= 1  # through 64 and the largest that fits
    assert abs(wide.peak_bytes(1_000) - peak(1_000)) <= peak(1_000) // 100
    assert abs(secant.peak_bytes(1_000) - peak(1_000)) > 100_000  # slope 512 from one block
    assert fit_wide_line(points[:1]) is None


def test_the_stored_line_never_has_negative_fixed_bytes() -> None:
    # gpt2-tiny at seq-len 64 on fake tensors: 60110 and 60111 differ by one 1.37 MiB
    # allocation, and the secant through them crosses zero at -144.64 MiB.
    seen = {1: 3_677_184, 64: 93_667_840, 32_832: 46_918_877_696, 60_110: 85_898_921_472}
    points = [Point(micro_batch_size=n, fits=True, peak_bytes=b) for n, b in seen.items()]
    points.append(Point(micro_batch_size=60_111, fits=False, peak_bytes=85_900_353_024))
    secant = fit_memory_model(points, prior=None)
    assert secant is not None and secant.fixed_bytes < 0  # the fault the stored line avoids
    wide = fit_wide_line(points)
    assert wide == MemoryModel(fixed_bytes=2_212_352, bytes_per_sample=1_428_992)  # 64 to 60110
    # No pair far apart: the secant's negative line is refitted from the smallest fitting size.
    near = [
        Point(micro_batch_size=1, fits=True, peak_bytes=1_000),
        Point(micro_batch_size=100, fits=True, peak_bytes=100_000),
        Point(micro_batch_size=101, fits=False, peak_bytes=101_500),
    ]
    assert fit_memory_model(near, prior=None) == MemoryModel(
        fixed_bytes=-50_000, bytes_per_sample=1_500
    )
    assert fit_wide_line(near) == MemoryModel(fixed_bytes=0, bytes_per_sample=1_000)


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


@pytest.mark.parametrize(("broke_at", "expected"), [(1, 1), (40, 39), (81, 80)])
def test_recommended_size_never_reaches_a_measured_peak_over_the_margin(
    broke_at: int, expected: int
) -> None:
    # The line (1_000 + 100 n) says 80 keeps 10% of 10_000 free, but the peak measured at
    # ``broke_at`` broke the margin: peaks grow with the size, so nothing from there up is
    # recommended (a tiny card where even 1 breaks it gets 1, on every rank alike).
    points = [
        Point(micro_batch_size=1, fits=True, peak_bytes=1_100 if broke_at > 1 else 9_500),
        Point(micro_batch_size=broke_at, fits=True, peak_bytes=9_500),
        Point(micro_batch_size=90, fits=True, peak_bytes=10_000),
        Point(micro_batch_size=91, fits=False),
    ]
    line = MemoryModel(fixed_bytes=1_000, bytes_per_sample=100)
    kept = recommended_size(points, capacity_bytes=10_000, safety_margin=0.1, model=line)
    assert kept == expected


@pytest.mark.parametrize("warm_up_size", [1, 2])
def test_a_warm_up_over_the_margin_leaves_the_smallest_size_that_trained(warm_up_size: int) -> None:
    # The line through 20 and 40 (flat below, allocator rounding) says 10 keeps 10% free, but the
    # warm-up's peak (kept out of its point) already broke the margin: every later step holds
    # the optimizer state it created, so no size keeps it; the smallest that trained is the
    # answer (2 where 1 cannot train: BatchNorm).
    points = [
        Point(micro_batch_size=warm_up_size, fits=True, warm_up=True),
        Point(micro_batch_size=20, fits=True, peak_bytes=9_300),
        Point(micro_batch_size=40, fits=True, peak_bytes=9_900),
        Point(micro_batch_size=41, fits=False),
    ]
    line = MemoryModel(fixed_bytes=8_700, bytes_per_sample=30)
    kept = {"capacity_bytes": 10_000, "safety_margin": 0.1, "model": line}
    assert recommended_size(points, **kept, warm_up_peak_bytes=9_100) == warm_up_size
    assert recommended_size(points, **kept, warm_up_peak_bytes=8_900) == 10  # the line
    assert recommended_size(points, **kept) == 10  # unknown
    # Without a warm-up (the estimate's fake steps), sizes below the smallest tried may keep it.
    fake = [p for p in points if not p.warm_up]
    assert recommended_size(fake, **kept, warm_up_peak_bytes=9_100) == 10
    kept["safety_margin"] = 0.2  # 8_000: every size tried breaks it, the line says 0
    assert recommended_size(fake, **kept) == 1


# -- safeguards: any monotone failure pattern, whatever the peaks say ------------------------


def run_pattern(
    threshold: int,
    *,
    limit: int,
    peak: Callable[[int], int],
    capacity: int = 10**9,
    prior: MemoryModel | None = None,
    first: int | None = None,
    warm_up: bool = True,
) -> list[Point]:
    """Drive the search as the probe does (warm-up at 1, then the estimate's ``first`` size, then
    the search) against a step that fails above ``threshold`` (an OOM or a launch limit: no
    peak) and otherwise reports ``peak(n)``, fitting when that is within ``capacity``."""
    points: list[Point] = []

    def trial(size: int, *, is_warm_up: bool = False) -> None:
        assert size not in {p.micro_batch_size for p in points}, "a size was tried twice"
        assert 1 <= size <= limit
        ran = size <= threshold
        measured = peak(size) if ran and not is_warm_up else 0
        points.append(
            Point(
                micro_batch_size=size,
                fits=ran and measured <= capacity,
                peak_bytes=measured,
                warm_up=is_warm_up,
            )
        )

    if warm_up:
        trial(1, is_warm_up=True)
    tried = {p.micro_batch_size for p in points}
    size = first if first is not None and first not in tried else None
    size = size or next_micro_batch_size(points, capacity_bytes=capacity, limit=limit, prior=prior)
    while size is not None:
        trial(size)
        size = next_micro_batch_size(points, capacity_bytes=capacity, limit=limit, prior=prior)
        assert len(points) < 100
    return points


def search_trials(points: list[Point]) -> int:
    return sum(1 for p in points if not p.warm_up)


TINY_PRIOR = MemoryModel(fixed_bytes=1_000, bytes_per_sample=1)


@pytest.mark.parametrize(
    ("threshold", "limit", "max_trials", "max_failures"),
    [
        # doubling-then-bisect: 4 OOMs (37), 1 (1), 1 (19999), 0, 1 (4095), 1 (65535);
        # bisection from the failed limit: 15 trials and 11 OOMs at 37, 15 and 15 at 1
        (37, 20_000, 12, 4),
        (1, 20_000, 3, 3),
        (19_999, 20_000, 18, 1),  # below the failed size: every trial fits, the budget spent
        (20_000, 20_000, 1, 0),
        (4_095, 4_096, 15, 1),
        (65_535, 65_536, 19, 1),  # a launch limit at 65536
    ],
)
def test_a_threshold_the_peaks_do_not_predict_is_found_from_what_ran(
    threshold: int, limit: int, max_trials: int, max_failures: int
) -> None:
    # peaks stay tiny, so the estimate says every size fits and proposes the limit
    points = run_pattern(
        threshold, limit=limit, peak=lambda n: 1_000 + n, prior=TINY_PRIOR, first=limit
    )
    assert bracket(points)[0] == threshold
    assert search_trials(points) <= max_trials <= trial_budget(limit)
    assert sum(not p.fits for p in points) <= max_failures
    sizes = [p.micro_batch_size for p in points]
    creep = [
        (a, b, c)
        for a, b, c in zip(sizes, sizes[1:], sizes[2:], strict=False)
        if a - 1 == b == c + 1
    ]
    assert not creep


def road(threshold: int, limit: int, *, estimate: bool) -> tuple[int, int]:
    """``(real steps, failures)`` of the search on a step that fails above ``threshold`` with
    tiny peaks (the estimate, when given, proposes the limit): the warm-up and the chosen
    size's second step counted, as ``bench/search_bounds.py`` counts them."""
    points = run_pattern(
        threshold,
        limit=limit,
        peak=lambda n: 1_000 + n,
        prior=TINY_PRIOR if estimate else None,
        first=limit if estimate else None,
    )
    assert bracket(points)[0] == threshold
    return len(points) + 1, sum(not p.fits for p in points)


@pytest.mark.parametrize("estimate", [False, True])
def test_every_threshold_at_256_within_doubling_plus_two_and_the_stated_worst_case(
    estimate: bool,
) -> None:
    # issue 47's bars, on every threshold: the search from the warm-up alone and after the
    # estimate's failed jump to the limit (its OOM counted)
    worst_case = (256 - 1).bit_length() + 5  # ceil(log2(limit)) + 5 real steps: 13
    total = weights = doubling = 0.0
    for threshold in range(1, 257):
        steps, failures = road(threshold, 256, estimate=estimate)
        assert steps <= worst_case
        assert (
            failures
            <= doubling_failures(threshold, 256) + DOUBLING_EXCESS
            == (doubling_failures(threshold, 256) + 2)
        )
        weight = math.log((threshold + 1) / threshold)
        total += weight * failures
        doubling += weight * doubling_failures(threshold, 256)
        weights += weight
    # log-uniform means (bench/search_bounds.py: the least any search within 13 steps reaches
    # is 2.51 from scratch, 3.75 after the failed limit with every threshold within + 2)
    assert doubling / weights == pytest.approx(2.88, abs=0.005)
    assert total / weights == pytest.approx(3.91 if estimate else 2.51, abs=0.005)


def test_thresholds_under_20000_sampled_within_doubling_plus_two() -> None:
    for threshold in [*range(1, 300, 7), *range(300, 20_001, 997), 8191, 16383, 19_999]:
        for estimate in (False, True):
            steps, failures = road(threshold, 20_000, estimate=estimate)
            assert steps <= trial_budget(20_000) + 2 == 20
            assert failures <= doubling_failures(threshold, 20_000) + 2


def test_doubling_failures_by_hand() -> None:
    # 2, 4 fit, 8 fails, 6 fits, 7 fails: one bisection failure and the doubling's
    assert doubling_failures(6, 20_000) == 2
    assert doubling_failures(7, 20_000) == 1  # 8 fails, 6 and 7 fit
    assert doubling_failures(37, 20_000) == 4  # 64, 48, 40 fail, and 38
    assert doubling_failures(20_000, 20_000) == 0  # ..., 16384, then the limit fits
    assert doubling_failures(1, 20_000) == 1  # 2 fails


def test_a_few_small_sizes_with_trials_to_spare_are_scanned_upwards() -> None:
    # 20000 failed (the estimate proposed it) and 138 too: 1..137 with 16 trials left; the
    # search tries 2, 3, 4, ... while one failure can still settle the rest
    points = [
        Point(micro_batch_size=1, fits=True, warm_up=True),
        Point(micro_batch_size=20_000, fits=False),
        Point(micro_batch_size=138, fits=False),
    ]
    size = next_micro_batch_size(points, capacity_bytes=10**9, limit=20_000, prior=TINY_PRIOR)
    assert size == 2
    # with no trial to spare (8 left, as bisection of 137 sizes needs), only sizes that leave
    # at most 2**7 on either side remain (10..129): the cheapest of them, not the scan
    spent = [Point(micro_batch_size=1_000 + i, fits=False) for i in range(8)]
    size = next_micro_batch_size(
        [*points, *spent], capacity_bytes=10**9, limit=20_000, prior=TINY_PRIOR
    )
    assert size == 30


def test_two_adjacent_sizes_with_one_peak_leave_the_line_to_an_earlier_point() -> None:
    # 647 and 648 share a peak (allocator rounding): the line goes through 645 and 648
    points = [
        Point(micro_batch_size=645, fits=True, peak_bytes=1_000 + 300 * 645),
        Point(micro_batch_size=647, fits=True, peak_bytes=1_000 + 300 * 648),
        Point(micro_batch_size=648, fits=True, peak_bytes=1_000 + 300 * 648),
    ]
    line = fit_memory_model(points, prior=None)
    assert line == MemoryModel(fixed_bytes=1_000, bytes_per_sample=300)
    # so the search tries one above the max, not a third of the way to a far failure
    points.append(Point(micro_batch_size=704, fits=False))
    size = next_micro_batch_size(
        points, capacity_bytes=1_000 + 300 * 648, limit=1 << 16, prior=None
    )
    assert size == 649


PEAKS = st.sampled_from(["tiny", "linear", "flat", "noisy", "flat_then_steep"])


def peak_curve(kind: str, seed: int) -> Callable[[int], int]:
    if kind == "tiny":
        return lambda n: 1_000 + n
    if kind == "linear":
        return lambda n: 10_000 + 300 * n
    if kind == "flat":  # no secant through any two points
        return lambda n: 5 * 10**5
    if kind == "noisy":  # jitter below the slope: still increasing
        return lambda n: 1_000 + 300 * n + (n * 2_654_435_761 + seed) % 299
    return lambda n: max(500_000, 10 * n * n)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 1 << 13),
    threshold_fraction=st.floats(0, 1),
    kind=PEAKS,
    seed=st.integers(0, 10**6),
    capacity=st.integers(10**4, 10**8),
    prior_slope=st.one_of(st.none(), st.integers(1, 10**5)),
    first_fraction=st.one_of(st.none(), st.floats(0, 1)),
    warm_up=st.booleans(),
)
def test_property_any_monotone_pattern_exact_within_the_budget(
    limit: int,
    threshold_fraction: float,
    kind: str,
    seed: int,
    capacity: int,
    prior_slope: int | None,
    first_fraction: float | None,
    warm_up: bool,
) -> None:
    threshold = max(1 if warm_up else 0, round(threshold_fraction * limit))
    peak = peak_curve(kind, seed)
    prior = (
        None
        if prior_slope is None
        else MemoryModel(fixed_bytes=1_000, bytes_per_sample=prior_slope)
    )
    first = None if first_fraction is None else max(1, round(first_fraction * limit))
    points = run_pattern(
        threshold,
        limit=limit,
        peak=peak,
        capacity=capacity,
        prior=prior,
        first=first,
        warm_up=warm_up,
    )
    # the answer: the largest n such that every size up to n runs and fits (the warm-up has no
    # peak to compare)
    expected = 0
    for n in range(1, threshold + 1):
        if (n > 1 or not warm_up) and peak(n) > capacity:
            break
        expected = n
    assert bracket(points)[0] == expected
    assert search_trials(points) <= trial_budget(limit)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(2, 1 << 16),
    threshold_exponent=st.floats(0, 1),
    first_is_limit=st.booleans(),
    kind=PEAKS,
    seed=st.integers(0, 10**6),
)
def test_property_a_contradicted_estimate_finds_the_exact_max_within_the_budget(
    limit: int, threshold_exponent: float, first_is_limit: bool, kind: str, seed: int
) -> None:
    # The estimate says every size fits (tiny prior) and proposes the limit, or a size near the
    # answer; real steps fail above a threshold spread log-uniformly over 1..limit (OOMs the
    # peaks do not predict). Whatever the peaks, the search ends at the exact max within
    # ceil(log2(limit)) + 3 trials besides the warm-up.
    threshold = min(limit, max(1, round(limit**threshold_exponent)))
    peak = peak_curve(kind, seed)
    capacity = 10**12  # the threshold, not the memory, bounds the sizes
    first = limit if first_is_limit else min(limit, 2 * threshold)
    points = run_pattern(
        threshold, limit=limit, peak=peak, capacity=capacity, prior=TINY_PRIOR, first=first
    )
    assert bracket(points)[0] == threshold
    assert search_trials(points) <= trial_budget(limit)
