"""PURE: the largest micro-batch for a memory budget, from measured peaks, and how far it guessed.

Within the measured sizes a limit is read off the measured peaks (interpolated between them).
Past the largest size that really ran it is a prediction: a least-squares line through the
measured peaks where activations dominate (:func:`autobatch.planning._lines.fit_least_squares`),
whose predicted peak is raised by a margin that grows with the distance extrapolated
(:data:`EXTRAPOLATION_GROWTH`). A line that does not grow with the
micro-batch, or that does not pass near its own points, predicts nothing: that is an error asking
for a probe on the card in question.

Imports neither torch nor pynvml.

Example::

    peaks = {1: 1_700_000, 16: 9_700_000}          # micro-batch -> measured peak bytes
    limit_within(peaks, budget_bytes=8_000_000)     # 12: interpolated between 1 and 16
    size, prediction = predict_past(peaks, budget_bytes=190_000_000)
    size, prediction.margin                          # 163, 1.148 (the line's peak raised 115%)
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from autobatch.errors import ConfigError
from autobatch.planning._lines import Line, fit_least_squares
from autobatch.profile import MemoryModel, Trial

__all__ = [
    "EXTRAPOLATION_GROWTH",
    "FIT_TOLERANCE",
    "Prediction",
    "interpolated_peak_bytes",
    "limit_within",
    "measured_peaks",
    "predict_below",
    "predict_past",
]

EXTRAPOLATION_GROWTH = 0.125
"""Past the largest measured size ``n_m``, the line's peak at ``n`` is raised by
``EXTRAPOLATION_GROWTH * (n - n_m) / n_m`` of itself: 12.5% more margin per ``n_m`` samples
extrapolated, none at ``n_m``.

Why it grows in proportion to the distance: a line fitted where activations dominate misses any
term that grows faster than the micro-batch and is still small at the measured sizes (an
``n**2`` term such as a loss or an optimizer buffer that small batches hide, allocator rounding
of ever larger blocks). Relative to the line's per-sample bytes ``b * n``, a term ``c * n**2``
is ``(c / b) * n``, i.e. proportional to ``n`` (a second-order term the fit cannot see; on
the hazards of extrapolating a fitted line past its data see e.g. Montgomery, Peck and Vining,
*Introduction to Linear Regression Analysis*). The value 1/8 is a policy, not a bound, calibrated on
a step with a ``0.0004 * n**2`` term that appears only above ``n = 32``, probed up to 16,
planned for a card 20 times larger, default 5% safety margin): the true limit there is 180;
growth 0.10 plans 182 (out of memory), 0.11 plans 177, 1/8 plans 169. A term larger still can
beat any margin, which is why a predicted plan is confirmed by one real trial on arrival
(:func:`autobatch.autotune`)."""

FIT_TOLERANCE = 0.05
"""A line is trusted only when every point it was fitted to lies within this fraction of the
largest fitted peak (e.g. 5% of 10 GiB = 512 MiB)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """How a limit past the largest measured size was predicted (see :func:`predict_past`)."""

    largest_measured_micro_batch_size: int
    """The largest micro-batch whose step really ran (or, for an estimate, was traced)."""
    num_fit_points: int
    """Measured sizes the line was fitted to; 0 when it is the profile's stored memory model
    (the profile keeps no peaks to fit)."""
    fit_residual_bytes: int
    """Largest ``|measured - line|`` over those points, in bytes; 0 for a line through two."""
    fixed_bytes: int
    """The line's peak at micro-batch 0, in bytes."""
    bytes_per_sample: int
    """The line's slope, in bytes per sample (rounded up), > 0."""
    margin: float
    """At the predicted limit, the line's peak was raised by this fraction of itself
    (``EXTRAPOLATION_GROWTH * (n - n_m) / n_m``), >= 0."""

    def __post_init__(self) -> None:
        for name in (
            "largest_measured_micro_batch_size",
            "num_fit_points",
            "fit_residual_bytes",
            "fixed_bytes",
            "bytes_per_sample",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"a prediction's {name} must be an int, got {value!r}")
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, int | float):
            raise ConfigError(f"a prediction's margin must be a number >= 0, got {margin!r}")
        if not math.isfinite(margin):
            raise ConfigError(f"a prediction's margin must be a finite number >= 0, got {margin!r}")
        if self.largest_measured_micro_batch_size < 1 or self.num_fit_points < 0:
            raise ConfigError(
                f"prediction needs largest_measured_micro_batch_size >= 1 and num_fit_points "
                f">= 0, got {self.largest_measured_micro_batch_size} and {self.num_fit_points}"
            )
        if self.bytes_per_sample <= 0 or self.fit_residual_bytes < 0 or not self.margin >= 0:
            raise ConfigError(
                f"prediction needs bytes_per_sample > 0, fit_residual_bytes >= 0 and margin "
                f">= 0, got {self.bytes_per_sample}, {self.fit_residual_bytes}, {self.margin}"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Prediction:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: a field is missing, unknown or out of range.
        """
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"not a valid prediction: {exc}") from exc

    def describe(self, micro_batch_size: int) -> str:
        """One line for a plan's notes about the limit ``micro_batch_size``."""
        if self.num_fit_points:
            fit = (
                f"a line fitted to {self.num_fit_points} measured sizes (largest residual "
                f"{self.fit_residual_bytes} bytes)"
            )
        else:
            fit = "the profile's stored memory line"
        return (
            f"max micro-batch {micro_batch_size} is predicted, not measured: the largest that "
            f"really ran is {self.largest_measured_micro_batch_size}; the peak comes from {fit}, "
            f"{self.fixed_bytes} + {self.bytes_per_sample} bytes per sample, raised by "
            f"{self.margin:.0%} for the distance extrapolated; one real trial on that card "
            "confirms it (autobatch.autotune there does)"
        )


def measured_peaks(trials: Iterable[Trial]) -> dict[int, int]:
    """Peak bytes by micro-batch size of every trial that ran to the end and was measured.

    Warm-up steps (their peak lacks the optimizer state) and failed steps (no peak) are left out;
    a size tried twice keeps its larger peak. A step that finished over the capacity counts: it
    really ran.
    """
    peaks: dict[int, int] = {}
    for trial in trials:
        peak = trial.peak_reserved_bytes or trial.peak_allocated_bytes
        if peak > 0 and not trial.warm_up:
            size = trial.micro_batch_size
            peaks[size] = max(peak, peaks.get(size, 0))
    return peaks


def peak_floor(trials: Iterable[Trial]) -> dict[int, int]:
    """Peak bytes by micro-batch size of every step that ran to the end, warm-ups included.

    A step's memory does not shrink as its micro-batch grows, so a peak measured at size ``m``
    is a floor under the peak at every size ``n >= m``, whatever a line says (a warm-up's peak
    at 1 already holds the weights, gradients and the optimizer state it creates).
    """
    floor: dict[int, int] = {}
    for trial in trials:
        peak = trial.peak_reserved_bytes or trial.peak_allocated_bytes
        if peak > 0:
            size = trial.micro_batch_size
            floor[size] = max(peak, floor.get(size, 0))
    return floor


def floor_at(floor: Mapping[int, int], micro_batch_size: int) -> int:
    """The largest peak measured at ``micro_batch_size`` or below (0 when none was)."""
    return max((peak for size, peak in floor.items() if size <= micro_batch_size), default=0)


def largest_above_floor(floor: Mapping[int, int], budget_bytes: int) -> int | None:
    """The largest size the measured floor allows within ``budget_bytes``: one below the
    smallest size whose measured peak exceeds it (0 when that is the smallest size measured);
    None when no measured peak exceeds the budget."""
    over = [size for size, peak in floor.items() if peak > budget_bytes]
    return min(over) - 1 if over else None


def interpolated_peak_bytes(peaks: Mapping[int, int], micro_batch_size: int) -> int | None:
    """The measured peak at ``micro_batch_size``, or the straight line between the measured
    sizes around it; None outside the measured sizes."""
    sizes = sorted(peaks)
    if not sizes or not sizes[0] <= micro_batch_size <= sizes[-1]:
        return None
    if micro_batch_size in peaks:
        return peaks[micro_batch_size]
    i = bisect.bisect_left(sizes, micro_batch_size)
    x0, x1 = sizes[i - 1], sizes[i]
    y0, y1 = peaks[x0], peaks[x1]
    return y0 + -(-(y1 - y0) * (micro_batch_size - x0) // (x1 - x0))


def limit_within(peaks: Mapping[int, int], budget_bytes: int) -> int:
    """The largest measured-range size whose (interpolated) peak is at most ``budget_bytes``;
    0 when even the smallest measured size exceeds it or nothing was measured."""
    sizes = sorted(peaks)
    best = max((n for n in sizes if peaks[n] <= budget_bytes), default=0)
    for low, high in zip(sizes, sizes[1:], strict=False):
        if peaks[low] <= budget_bytes < peaks[high]:
            # The segment's line crosses the budget: the last n before it does.
            room = (budget_bytes - peaks[low]) * (high - low) // (peaks[high] - peaks[low])
            candidate = low + room
            while (
                candidate > low and (interpolated_peak_bytes(peaks, candidate) or 0) > budget_bytes
            ):
                candidate -= 1
            best = max(best, candidate)
    return best


def _line(peaks: Mapping[int, int], stored: MemoryModel | None) -> Line:
    """The measured line, or the stored model when fewer than two sizes were measured.

    Raises:
        ConfigError: no line at all, a line that does not grow, or a poor fit.
    """
    if len(peaks) < 2:
        if stored is None:
            raise ConfigError(
                f"the profile has peaks measured at {len(peaks)} micro-batch size(s) and no "
                "memory model, so it cannot predict a micro-batch outside them; probe on that card "
                "(autobatch.autotune there, device='cuda:N')"
            )
        return Line(
            fixed_bytes=float(stored.fixed_bytes),
            bytes_per_sample=float(stored.bytes_per_sample),
            num_points=0,
            residual_bytes=0,
        )
    line = fit_least_squares(peaks)
    fitted = {n: peaks[n] for n in sorted(peaks)[-line.num_points :]}
    if line.bytes_per_sample <= 0:
        raise ConfigError(
            f"the measured peaks do not grow with the micro-batch (a line through {fitted} has "
            f"slope {line.bytes_per_sample:.4g} bytes per sample), so no larger micro-batch can be "
            "predicted from them; probe on that card instead (autobatch.autotune "
            "there, device='cuda:N')"
        )
    tolerance = FIT_TOLERANCE * max(fitted.values())
    if line.residual_bytes > tolerance:
        raise ConfigError(
            f"the measured peaks {fitted} are not on a line (largest residual "
            f"{line.residual_bytes} bytes, over {FIT_TOLERANCE:.0%} of the largest peak), so a "
            "prediction past them cannot be trusted; probe on that card instead "
            "(autobatch.autotune there, device='cuda:N')"
        )
    return line


def predict_past(
    peaks: Mapping[int, int],
    *,
    budget_bytes: int,
    stored: MemoryModel | None = None,
    largest_measured_micro_batch_size: int = 0,
) -> tuple[int, Prediction]:
    """The largest micro-batch predicted to peak within ``budget_bytes``, past the measured sizes.

    Args:
        peaks: measured peak bytes by micro-batch size (:func:`measured_peaks`); with fewer than
            two sizes, ``stored`` is the line.
        budget_bytes: peak bytes the step may reach on the card planned for (capacity minus the
            safety margin).
        stored: the profile's memory model, used only without two measured sizes.
        largest_measured_micro_batch_size: where extrapolation starts when ``peaks`` is empty
            (the profile's largest fitting size); default the largest of ``peaks``.

    Returns:
        ``(size, prediction)``; ``size`` is the largest ``n`` whose line peak raised by
        :data:`EXTRAPOLATION_GROWTH` stays within the budget, at least the largest measured size.

    Raises:
        ConfigError: the peaks do not grow with the micro-batch, are not on a line, or are too
            few (with no stored model): probe on that card.
    """
    line = _line(peaks, stored)
    largest = max(peaks, default=0) or max(largest_measured_micro_batch_size, 1)

    def raised(n: int) -> float:
        growth = EXTRAPOLATION_GROWTH * (n - largest) / largest
        return (line.fixed_bytes + line.bytes_per_sample * n) * (1 + growth)

    low = largest
    high = max(largest, math.floor((budget_bytes - line.fixed_bytes) / line.bytes_per_sample)) + 1
    while high - low > 1:  # raised() increases past ``largest``: bisect for the last n in budget
        middle = (low + high) // 2
        low, high = (middle, high) if raised(middle) <= budget_bytes else (low, middle)
    return low, Prediction(
        largest_measured_micro_batch_size=largest,
        num_fit_points=line.num_points,
        fit_residual_bytes=line.residual_bytes,
        fixed_bytes=round(line.fixed_bytes),
        bytes_per_sample=math.ceil(line.bytes_per_sample),
        margin=EXTRAPOLATION_GROWTH * (low - largest) / largest,
    )


def predict_below(
    peaks: Mapping[int, int],
    *,
    budget_bytes: int,
    stored: MemoryModel | None = None,
    largest_measured_micro_batch_size: int = 0,
) -> tuple[int, Prediction]:
    """The largest micro-batch the line puts within ``budget_bytes`` when even the smallest
    measured size does not fit it (0 when none does); arguments and errors as for
    :func:`predict_past`. No margin is added below the measured sizes."""
    line = _line(peaks, stored)
    smallest = min(peaks, default=0)
    size = max(0, math.floor((budget_bytes - line.fixed_bytes) / line.bytes_per_sample))
    if smallest:
        size = min(size, smallest - 1)
    return size, Prediction(
        largest_measured_micro_batch_size=max(peaks, default=0)
        or max(largest_measured_micro_batch_size, 1),
        num_fit_points=line.num_points,
        fit_residual_bytes=line.residual_bytes,
        fixed_bytes=round(line.fixed_bytes),
        bytes_per_sample=math.ceil(line.bytes_per_sample),
        margin=0.0,
    )
