"""PURE: which micro-batch size to try next, from the outcomes so far.

The probe (real trials) and the estimator (fake trials) share this search. It keeps the bracket
``lo`` (largest size that fitted) .. ``hi`` (smallest that did not) and proposes, in order of
preference:

1. the largest size a linear memory model predicts under the capacity, clamped into the bracket.
   The model is a line through the two most recent measured peaks (a secant step: peak memory is
   linear in the micro-batch where activations dominate, DESIGN.md), or the prior's slope through
   the largest fitting size, or the prior alone;
2. each miss (a predicted size that ran out of memory, so no new peak was measured) aims the next
   prediction at 10% less capacity, so the next try lands inside and gives a measured point;
   without a prior, growth before the first failure is capped at 4x per trial;
3. bisection (or doubling while there is no upper bound) whenever the last three trials failed to
   halve the bracket, so the worst case stays within about three times bisection's trial count.

Imports neither torch nor pynvml.

Example::

    points = [Point(micro_batch_size=1, fits=True, peak_bytes=1_100)]
    next_micro_batch_size(points, capacity_bytes=10_000, limit=4096, prior=None)   # 2 (doubling)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autobatch.profile import MemoryModel

__all__ = [
    "MAX_GROWTH",
    "MISS_BACKOFF",
    "Point",
    "bracket",
    "fit_memory_model",
    "next_micro_batch_size",
    "recommended_size",
]

MISS_BACKOFF = 0.10
"""Fraction of capacity given up per miss (a predicted size that did not fit) since the last
measured peak, so the next prediction lands inside and gives a measured point."""

MAX_GROWTH = 4
"""Without a prior and before any failure, a prediction may not exceed this many times the
largest fitting size: lines through tiny sizes, where the optimizer step dominates, overshoot."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    """The outcome of one trial, as the search sees it."""

    micro_batch_size: int
    fits: bool
    peak_bytes: int = 0
    """Measured peak (compared with the capacity); 0 when unknown (the trial ran out of memory).
    A trial that finished over the capacity (an estimate, or a CUDA step over budget) has
    ``fits=False`` and a known peak."""


def bracket(points: Sequence[Point]) -> tuple[int, int | None]:
    """``(lo, hi)``: largest fitting size (0 if none) and smallest non-fitting size (None)."""
    lo = max((p.micro_batch_size for p in points if p.fits), default=0)
    hi = min((p.micro_batch_size for p in points if not p.fits), default=None)
    return lo, hi


def fit_memory_model(points: Sequence[Point], prior: MemoryModel | None) -> MemoryModel | None:
    """A line ``fixed + per_sample * n`` through the measured fitting points (see module doc).

    Returns:
        The line through two measured points; else the prior's slope anchored on the largest
        measured fitting size above 1; else the prior itself (None without one).
    """
    known = [p for p in points if p.peak_bytes > 0]
    fitted = sorted((p for p in known if p.fits), key=lambda p: p.micro_batch_size)
    over = sorted((p for p in known if not p.fits), key=lambda p: p.micro_batch_size)
    recent = [p for p in known if p.micro_batch_size != known[-1].micro_batch_size] if known else []
    pair = None
    if recent and recent[-1].peak_bytes != known[-1].peak_bytes:
        pair = tuple(sorted((recent[-1], known[-1]), key=lambda p: p.micro_batch_size))
    elif fitted and over:
        pair = (fitted[-1], over[0])
    elif len(fitted) >= 2:
        pair = (fitted[-2], fitted[-1])
    elif len(over) >= 2:
        pair = (over[0], over[1])
    if pair is not None:
        small, large = pair
        if large.micro_batch_size > small.micro_batch_size and large.peak_bytes > small.peak_bytes:
            per_sample = -(
                -(large.peak_bytes - small.peak_bytes)
                // (large.micro_batch_size - small.micro_batch_size)
            )
            model = MemoryModel(
                fixed_bytes=large.peak_bytes - per_sample * large.micro_batch_size,
                bytes_per_sample=per_sample,
            )
            return model
    if prior is None:
        return None
    if fitted and fitted[-1].micro_batch_size > 1:
        anchor = fitted[-1]
        model = MemoryModel(
            fixed_bytes=anchor.peak_bytes - prior.bytes_per_sample * anchor.micro_batch_size,
            bytes_per_sample=prior.bytes_per_sample,
        )
        return model
    return prior


def _halved(points: Sequence[Point], index: int) -> bool:
    """Did trial ``index`` at least halve the bracket (or extend an unbounded one)?"""
    lo_before, hi_before = bracket(points[:index])
    lo_after, hi_after = bracket(points[: index + 1])
    if hi_before is None:
        return hi_after is None and lo_after >= 2 * max(lo_before, 1) or hi_after is not None
    width_before = hi_before - lo_before
    assert hi_after is not None
    return 2 * (hi_after - lo_after) <= width_before


def next_micro_batch_size(
    points: Sequence[Point],
    *,
    capacity_bytes: int,
    limit: int,
    prior: MemoryModel | None,
) -> int | None:
    """The next size to try, or None when the search is over.

    Args:
        points: every trial so far, in order; at least one.
        capacity_bytes: peak bytes a step may reach.
        limit: largest size worth trying (>= 1).
        prior: an estimate of the memory line (e.g. from fake-tensor tracing), or None.

    Returns:
        A size in ``(lo, hi)`` (or ``(lo, limit]`` without an upper bound), never one already tried;
        None when ``hi == lo + 1``, when ``lo`` reached ``limit``, or when size 1 did not fit.
    """
    lo, hi = bracket(points)
    upper = limit if hi is None else min(limit, hi - 1)
    if lo >= upper or (hi is not None and lo == 0 and hi == 1):
        return None
    stalled = len(points) >= 4 and not any(
        _halved(points, index) for index in range(len(points) - 3, len(points))
    )
    model = fit_memory_model(points, prior)
    if model is not None and not stalled:
        last_known = max((i for i, p in enumerate(points) if p.peak_bytes > 0), default=-1)
        misses = sum(1 for p in points[last_known + 1 :] if not p.fits)
        target = int(capacity_bytes * max(0.0, 1 - MISS_BACKOFF * misses))
        predicted = model.max_micro_batch_size(target)
        if hi is None and prior is None:
            predicted = min(predicted, MAX_GROWTH * max(lo, 1))
        return max(lo + 1, min(predicted, upper))
    if hi is None:
        return min(max(2 * lo, 1), upper)
    return (lo + hi) // 2


def recommended_size(
    points: Sequence[Point],
    *,
    capacity_bytes: int,
    safety_margin: float,
    model: MemoryModel | None,
) -> int:
    """Largest fitting size whose peak keeps ``safety_margin`` of the capacity free; at least 1.

    Uses measured peaks where the size was tried, the memory model between them.
    """
    lo, _ = bracket(points)
    budget = int(capacity_bytes * (1 - safety_margin))
    measured = {p.micro_batch_size: p.peak_bytes for p in points if p.fits and p.peak_bytes > 0}
    best = max((n for n, peak in measured.items() if peak <= budget), default=1)
    if model is not None:
        best = max(best, min(lo, model.max_micro_batch_size(budget)))
    return max(1, min(best, lo)) if lo else 1
