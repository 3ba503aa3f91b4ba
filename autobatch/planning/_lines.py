"""PURE: straight lines of peak bytes over micro-batch size, fitted to measured points.

Peak memory is close to ``fixed + per_sample * n`` where activations dominate
(docs/how-it-works.md, "The probe"). Every such line autobatch fits is here, for two jobs:

- steering a search (:mod:`autobatch.probing._search`, the probe's and the estimate's):
  :func:`fit_memory_model`, an integer :class:`~autobatch.profile.MemoryModel` through two
  points (the two latest measured peaks, or a prior's fixed bytes and the largest fitting size),
  and :func:`fit_wide_line`, through two points far apart. Their slope is rounded up to whole
  bytes per sample, and the line passes through the larger point exactly;
- predicting past the measured sizes (:mod:`autobatch.planning._prediction`):
  :func:`fit_least_squares`, a least-squares :class:`Line` through the measured sizes from half
  the largest up, with its largest residual, in floats (the prediction rounds what it reports).

Points are anything with ``micro_batch_size``, ``fits`` and ``peak_bytes``
(:class:`MeasuredPoint`, e.g. :class:`autobatch.probing._search.Point`), or a mapping of peak bytes
by micro-batch size. Imports neither torch nor pynvml.

Example::

    fit_least_squares({8: 1_800, 16: 2_600, 32: 4_200})
    # Line(fixed_bytes=1000.0, bytes_per_sample=100.0, num_points=2, residual_bytes=0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from autobatch.profile import MemoryModel

__all__ = ["Line", "MeasuredPoint", "fit_least_squares", "fit_memory_model", "fit_wide_line"]


class MeasuredPoint(Protocol):
    """One trial's outcome, as a line fit reads it."""

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def fits(self) -> bool:
        """Whether the step fitted (ran within the capacity)."""
        ...

    @property
    def peak_bytes(self) -> int:
        """Measured peak bytes; 0 when unknown (the step ran out of memory)."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Line:
    """A least-squares line ``fixed_bytes + bytes_per_sample * n`` and how well it fits."""

    fixed_bytes: float
    """The line's peak at micro-batch 0, in bytes."""
    bytes_per_sample: float
    """The line's slope, in bytes per sample."""
    num_points: int
    """Measured sizes it was fitted to (0 for a stored line)."""
    residual_bytes: int
    """Largest ``|measured - line|`` over those points, rounded up, in bytes."""


def fit_memory_model(
    points: Sequence[MeasuredPoint], prior: MemoryModel | None
) -> MemoryModel | None:
    """A line ``fixed + per_sample * n`` through the measured fitting points (see
    :mod:`autobatch.probing._search`).

    Returns:
        The line through two measured points (the latest, and the latest before it of another
        size and peak); else the line from the prior's fixed bytes through
        the largest measured fitting size above 1 (the prior's slope through it when its peak is
        not above those bytes); else the prior itself (None without one).
    """
    known = [p for p in points if p.peak_bytes > 0]
    fitted = sorted((p for p in known if p.fits), key=lambda p: p.micro_batch_size)
    over = sorted((p for p in known if not p.fits), key=lambda p: p.micro_batch_size)
    # The latest point and the latest before it with another size and another peak: two adjacent
    # sizes often share a peak (allocator rounding), and no line goes through them.
    recent = [
        p
        for p in known
        if p.micro_batch_size != known[-1].micro_batch_size and p.peak_bytes != known[-1].peak_bytes
    ]
    pair = None
    if recent:
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
            return _secant(small, large)
    if prior is None:
        return None
    if fitted and fitted[-1].micro_batch_size > 1:
        anchor = fitted[-1]
        if anchor.peak_bytes > prior.fixed_bytes:
            # The prior's fixed bytes (weights, gradients, optimizer state) are what an estimate
            # gets right; its slope (activations) is what it gets wrong, by any factor.
            per_sample = -(-(anchor.peak_bytes - prior.fixed_bytes) // anchor.micro_batch_size)
        else:
            per_sample = prior.bytes_per_sample
        return _through(anchor.micro_batch_size, anchor.peak_bytes, per_sample)
    return prior


def fit_wide_line(
    points: Sequence[MeasuredPoint], prior: MemoryModel | None = None
) -> MemoryModel | None:
    """A line through the largest fitting peak and one at no more than half its size (at least
    2, past where the optimizer step may dominate): far apart, so allocator rounding does not
    tilt it, and it predicts the peak across the range, where :func:`fit_memory_model`'s secant
    through the two latest points (often adjacent sizes) is only good near them. Falls back to
    :func:`fit_memory_model` (that secant, else the ``prior``'s lines) when there is no such pair.

    Its fixed bytes are never negative (no step needs less than nothing at micro-batch 0): a
    line that would cross below zero, as a secant through two adjacent sizes whose peaks differ
    by one allocation's rounding does, is refitted through the smallest measured fitting size
    and the largest, else through zero and the largest (:func:`_not_below_zero`).
    """
    known = sorted((p for p in points if p.peak_bytes > 0), key=lambda p: p.micro_batch_size)
    fitted = [p for p in known if p.fits]
    line = None
    if fitted:
        large = fitted[-1]
        below = [
            p
            for p in known
            if 2 <= p.micro_batch_size <= large.micro_batch_size // 2
            and p.peak_bytes < large.peak_bytes
        ]
        if below:
            line = _secant(below[-1], large)
    if line is None:
        line = fit_memory_model(points, prior)
    return _not_below_zero(line, fitted)


def _not_below_zero(
    line: MemoryModel | None, fitted: Sequence[MeasuredPoint]
) -> MemoryModel | None:
    """``line``, or where its fixed bytes are negative a line through the largest fitting point
    that is not: the secant from the smallest fitting point, else the line from zero (its slope
    the largest point's bytes per sample, rounded down so the fixed bytes are the remainder)."""
    if line is None or line.fixed_bytes >= 0 or not fitted:
        return line
    small, large = fitted[0], fitted[-1]
    if small.micro_batch_size < large.micro_batch_size and small.peak_bytes < large.peak_bytes:
        refit = _secant(small, large)
        if refit.fixed_bytes >= 0:
            return refit
    per_sample = large.peak_bytes // large.micro_batch_size
    if per_sample < 1:
        return line
    return _through(large.micro_batch_size, large.peak_bytes, per_sample)


def _secant(small: MeasuredPoint, large: MeasuredPoint) -> MemoryModel:
    """The line through ``large`` whose slope is that from ``small`` (a smaller size with a
    smaller peak) rounded up to whole bytes per sample."""
    rise = large.peak_bytes - small.peak_bytes
    per_sample = -(-rise // (large.micro_batch_size - small.micro_batch_size))
    return _through(large.micro_batch_size, large.peak_bytes, per_sample)


def _through(size: int, peak_bytes: int, per_sample: int) -> MemoryModel:
    """The line of slope ``per_sample`` through ``(size, peak_bytes)``."""
    return MemoryModel(fixed_bytes=peak_bytes - per_sample * size, bytes_per_sample=per_sample)


def fit_least_squares(peaks: Mapping[int, int]) -> Line:
    """Least squares through the measured sizes where activations dominate.

    Uses the sizes from half the largest measured size up; when fewer than two lie there, the two
    largest (a line through tiny sizes, where the optimizer step dominates, has too small a
    slope: docs/how-it-works.md, "The probe").

    Args:
        peaks: measured peak bytes by micro-batch size, two sizes at least.
    """
    sizes = sorted(peaks)
    largest = sizes[-1]
    used = [n for n in sizes if 2 * n >= largest]
    if len(used) < 2:
        used = sizes[-2:]
    mean_x = sum(used) / len(used)
    mean_y = sum(peaks[n] for n in used) / len(used)
    sxx = sum((n - mean_x) ** 2 for n in used)
    sxy = sum((n - mean_x) * (peaks[n] - mean_y) for n in used)
    per_sample = sxy / sxx
    fixed = mean_y - per_sample * mean_x
    residual = max(abs(peaks[n] - (fixed + per_sample * n)) for n in used)
    return Line(
        fixed_bytes=fixed,
        bytes_per_sample=per_sample,
        num_points=len(used),
        residual_bytes=math.ceil(residual - 1e-6),
    )
