"""PURE: what a plan's limit resolves to: a number, a profile (for its own or another card), or a
memory line and a capacity.

The planner's first step (:func:`resolve_limit`), apart from the search for a split: the largest
micro-batch that may run, where that number came from (:data:`PlanSource`), the peak-bytes and
step-time models the plan reports with, and the prediction when the limit lies outside what was
measured (:mod:`autobatch.planning._prediction`). Imports neither torch nor pynvml.

Example::

    limit = resolve_limit(profile, capacity_bytes=80 * 2**30, safety_margin=None,
                          step_seconds=None, source="cached")
    limit.max_micro_batch_size, limit.source      # e.g. (171, "predicted")
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from autobatch.conditions import Conditions
from autobatch.errors import ConfigError, NoFeasiblePlanError, Remedy
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning._prediction import (
    Prediction,
    floor_at,
    interpolated_peak_bytes,
    largest_above_floor,
    limit_within,
    measured_peaks,
    peak_floor,
    predict_below,
    predict_past,
)
from autobatch.profile import MemoryModel, Profile
from autobatch.units import format_bytes

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "Limit",
    "PlanSource",
    "StepTimes",
    "check_step_seconds",
    "require_int",
    "resolve_limit",
    "stored_profile_source",
]

PlanSource = Literal["measured", "cached", "estimated", "given", "predicted"]
SOURCES: tuple[PlanSource, ...] = ("measured", "cached", "estimated", "given", "predicted")


def stored_profile_source(profile: Profile) -> PlanSource:
    """The source of a plan from a profile read from a store, whoever reads it (``autotune``'s
    cache, ``autobatch plan --profile``, ``POST /v1/plan``): ``"cached"`` (real trials, run
    before this call), or ``"estimated"`` for an estimate's profile. One answer for every way in,
    so the same stored profile never reads ``measured`` by one road and ``cached`` by another."""
    return "estimated" if profile.method == "estimate" else "cached"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepTimes:
    """Seconds of one training step by micro-batch size, and how far they can be trusted.

    The planner picks a split other than the fewest accumulation steps by throughput only when
    every micro-batch size of both splits was timed more than once and the faster split's
    slowest timing still beats the other's fastest (:meth:`seconds_range`): a difference smaller
    than the timings' spread, or timed once, is noise (a loaded machine, a first step's
    warm-up), and a plan that turned each optimizer step into 256 tiny passes on it is worse
    than none. Step times the caller gives are the caller's measurement and taken as exact.
    """

    seconds: Callable[[int], float]
    """Predicted seconds of one step at any size: interpolated through the mean timing of each
    measured size (see :func:`_step_time_model`)."""
    timings: Mapping[int, tuple[float, ...]]
    """Every timing of each measured size, in seconds (a profile's fitting trials, its warm-up
    left out: it also creates the optimizer state)."""
    exact: bool = False
    """True for step times the caller gave: each is taken as exact."""

    def seconds_range(self, size: int) -> tuple[float, float] | None:
        """The fastest and slowest timing of a step at ``size``: where the caller's step times
        are exact, the predicted time twice; None where ``size`` was not timed more than once."""
        if self.exact:
            value = self.seconds(size)
            return value, value
        times = self.timings.get(size, ())
        return (min(times), max(times)) if len(times) > 1 else None

    def describe(self, sizes: Iterable[int]) -> str:
        """The timings behind a choice at ``sizes``, for a note."""
        if self.exact:
            return "given step_seconds, taken as exact"
        parts = []
        for size in sorted(set(sizes)):
            times = self.timings.get(size, ())
            shown = ", ".join(f"{t:.4g}" for t in times) if times else "not timed"
            parts.append(f"micro-batch {size}: {shown} s")
        return "; ".join(parts)


@dataclasses.dataclass(kw_only=True, slots=True)
class Limit:
    """What a limit (number, profile or memory line) resolves to.

    Not frozen: a private value built once per plan and never changed; a frozen dataclass's
    ``object.__setattr__`` construction is a measurable share of a ``plan()`` call
    (``bench/plan_call.py``), which the service pays per request."""

    max_micro_batch_size: int
    """The largest micro-batch a plan may use."""
    source: PlanSource
    """Where it came from, as the plan reports it."""
    capacity_bytes: int | None
    """Bytes a step may use on the device planned for; None if unknown."""
    peak_bytes: Callable[[int], int | None]
    """Peak bytes of a step by micro-batch size (measured, interpolated or modelled); None
    where unknown."""
    step_time: StepTimes | None
    """Seconds of a step by micro-batch size; None without step times."""
    notes: tuple[str, ...]
    """What the plan notes about its limit."""
    prediction: Prediction | None = None
    """How a limit past the measured sizes was predicted; None when it was not."""
    conditions: Conditions = dataclasses.field(default_factory=Conditions)
    """The profile's conditions (empty for a number or a memory line)."""


def require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} {value!r} must be an int >= {minimum}")


def resolve_limit(
    limit: int | Profile | MemoryModel,
    *,
    capacity_bytes: int | None,
    safety_margin: float | None,
    step_seconds: Mapping[int, float] | None,
    source: PlanSource | None,
) -> Limit:
    step_time = (
        None
        if step_seconds is None
        else StepTimes(seconds=_step_time_model(step_seconds), timings={}, exact=True)
    )
    if source is not None and (source not in SOURCES or source == "predicted"):
        raise ConfigError(
            f"source {source!r} must be one of {list(SOURCES[:-1])}: where the limit came from "
            "('predicted' is the planner's own verdict on a limit outside the measured sizes)"
        )
    if isinstance(limit, MemoryModel):
        return _model_limit(limit, capacity_bytes, safety_margin, step_time, source or "given")
    if not isinstance(limit, Profile):
        return _plain_limit(limit, capacity_bytes, safety_margin, step_time, source)
    profile = limit
    base = _profile_source(profile, source)
    model = profile.memory_model
    margin = profile.safety_margin if safety_margin is None else safety_margin
    peaks = measured_peaks(profile.trials)

    def peak_bytes(size: int) -> int | None:
        measured = interpolated_peak_bytes(peaks, size)
        if measured is not None:
            return measured
        return None if model is None else model.peak_bytes(size)

    if capacity_bytes is not None:
        # Step times measured on the profiled device say nothing reliable about another one.
        return _profile_limit(profile, peaks, capacity_bytes, margin, base, step_time)
    limit_size, notes = _limit_at_margin(profile, peaks, margin, peak_bytes(1))
    failed = failure_limit(profile, int(profile.capacity_bytes * (1 - margin)))
    if failed is not None and failed[0] < limit_size:
        if failed[0] < 1:
            raise NoFeasiblePlanError(failed[1])
        limit_size, notes = failed[0], (*notes, *_failure_note(failed, failed[0]))
    if step_time is None:
        step_time = _profile_step_times(profile)
    return Limit(
        max_micro_batch_size=limit_size,
        source=base,
        capacity_bytes=profile.capacity_bytes,
        peak_bytes=peak_bytes,
        step_time=step_time,
        notes=notes,
    )


def _plain_limit(
    limit: int,
    capacity_bytes: int | None,
    safety_margin: float | None,
    step_time: StepTimes | None,
    source: PlanSource | None,
) -> Limit:
    """A plain max micro-batch size as the limit: no memory to scale, nothing to re-derive."""
    require_int("max micro-batch size (limit)", limit, 1)
    if capacity_bytes is not None or safety_margin is not None:
        raise ConfigError(
            "capacity_bytes and safety_margin need a Profile or a MemoryModel; "
            f"limit is a plain max micro-batch size {limit}"
        )
    return Limit(
        max_micro_batch_size=limit,
        source=source or "given",
        capacity_bytes=None,
        peak_bytes=lambda _: None,
        step_time=step_time,
        notes=(),
    )


def _profile_source(profile: Profile, source: PlanSource | None) -> PlanSource:
    """Where a plan from ``profile`` says its limit came from; refuses an evaluation profile,
    and a ``source`` that claims real trials for an estimate."""
    if profile.mode == "eval":
        raise ConfigError(
            "the profile measured evaluation (mode 'eval': a forward under inference_mode), not "
            "a training step; plan from a training profile, and use this one's "
            "recommended_micro_batch_size as the evaluation micro-batch",
            remedies=[Remedy(parameter="eval", values=(False,), purpose="a training profile")],
        )
    if profile.method == "estimate" and source in ("measured", "cached"):
        raise ConfigError(
            f"source {source!r} claims real trials, but the profile is an estimate (method "
            "'estimate': no step ran); pass source='estimated' or leave it unset"
        )
    return source or ("estimated" if profile.method == "estimate" else "measured")


def _limit_at_margin(
    profile: Profile, peaks: Mapping[int, int], margin: float, peak_at_one: int | None
) -> tuple[int, tuple[str, ...]]:
    """The profile's micro-batch limit on its own device under ``margin``: its recommended size
    at its own margin, else re-derived from its peaks (or its line), with the note saying so.
    ``peak_at_one``: the peak bytes at micro-batch 1, None when unknown."""
    if margin == profile.safety_margin:
        return profile.recommended_micro_batch_size, ()
    model = profile.memory_model
    if model is None and len(peaks) < 2:
        raise ConfigError(
            f"safety_margin {margin} differs from the profile's {profile.safety_margin}, but the "
            "profile has no memory model to re-derive the micro-batch; leave safety_margin unset"
        )
    budget_bytes = int(profile.capacity_bytes * (1 - margin))
    limit_size = limit_within(peaks, budget_bytes)
    if not limit_size:
        limit_size, _ = predict_below(peaks, budget_bytes=budget_bytes, stored=model)
    limit_size = min(profile.max_micro_batch_size, limit_size)
    needed = peak_at_one
    if needed is None:  # no stored line: the peaks (two sizes at least) start above 1
        needed = peaks[min(peaks)]
    _require_fits(limit_size, needed, budget_bytes, profile.capacity_bytes, margin)
    return limit_size, (f"max micro-batch {limit_size} re-derived for safety_margin {margin}",)


def _profile_step_times(profile: Profile) -> StepTimes | None:
    """The step times of a profile's fitting trials (the warm-up left out: it also creates the
    optimizer state); None with fewer than two sizes timed."""
    timed: dict[int, list[float]] = {}
    for trial in profile.trials:
        if trial.fits and trial.step_seconds > 0 and not trial.warm_up:
            timed.setdefault(trial.micro_batch_size, []).append(trial.step_seconds)
    if len(timed) < 2:
        return None
    means = {size: sum(times) / len(times) for size, times in timed.items()}
    return StepTimes(
        seconds=_step_time_model(means),
        timings={size: tuple(times) for size, times in timed.items()},
    )


def _model_limit(
    model: MemoryModel,
    capacity_bytes: int | None,
    safety_margin: float | None,
    step_time: StepTimes | None,
    source: PlanSource,
) -> Limit:
    """A caller's memory line and a capacity: the line is the caller's claim, taken as given."""
    if capacity_bytes is None:
        raise ConfigError(
            f"a memory model ({model.fixed_bytes} + {model.bytes_per_sample} bytes per sample) "
            "needs capacity_bytes: the device memory to plan for"
        )
    margin = DEFAULT_SAFETY_MARGIN if safety_margin is None else safety_margin
    budget_bytes = int(capacity_bytes * (1 - margin))
    limit_size = model.max_micro_batch_size(budget_bytes)
    _require_fits(limit_size, model.peak_bytes(1), budget_bytes, capacity_bytes, margin)
    note = (
        f"max micro-batch {limit_size} from the given memory model for capacity_bytes "
        f"{capacity_bytes} with safety_margin {margin}"
    )
    return Limit(
        max_micro_batch_size=limit_size,
        source=source,
        capacity_bytes=capacity_bytes,
        peak_bytes=model.peak_bytes,
        step_time=step_time,
        notes=(note,),
    )


def _profile_limit(
    profile: Profile,
    peaks: Mapping[int, int],
    capacity_bytes: int,
    margin: float,
    source: PlanSource,
    step_time: StepTimes | None,
) -> Limit:
    """A profile planned for another capacity: measured within its sizes, predicted past them."""
    model = profile.memory_model
    budget_bytes = int(capacity_bytes * (1 - margin))
    # No size may be planned at or past one whose measured peak (a warm-up's included) is over
    # the budget, whatever the line says: a step's memory does not shrink as its batch grows.
    floor = peak_floor(profile.trials)
    floor_limit = largest_above_floor(floor, budget_bytes)
    # Nor at or past a size that failed at this budget (see failure_limit).
    failed = failure_limit(profile, budget_bytes)
    if failed is not None:
        floor_limit = failed[0] if floor_limit is None else min(floor_limit, failed[0])
    within = limit_within(peaks, budget_bytes)
    if floor_limit is not None:
        within = min(within, floor_limit)
    largest = max(peaks, default=0)
    if peaks and within and within < largest:
        note = (
            f"max micro-batch {within} read off the peaks measured up to {largest} for "
            f"capacity_bytes {capacity_bytes} with safety_margin {margin}"
        )
        return Limit(
            max_micro_batch_size=within,
            source=source,
            capacity_bytes=capacity_bytes,
            peak_bytes=lambda size: interpolated_peak_bytes(peaks, size),
            step_time=step_time,
            notes=(note, *_failure_note(failed, within)),
        )
    if not peaks and model is None:
        raise ConfigError(
            f"the profile has no measured peaks and no memory model, so it cannot predict the "
            f"micro-batch for capacity_bytes {capacity_bytes}; probe on that device instead"
        )
    size, prediction = _predicted_size(profile, peaks, budget_bytes, fits_measured=bool(within))
    fixed, per_sample = prediction.fixed_bytes, prediction.bytes_per_sample
    if floor_limit is not None:
        size = min(size, floor_limit)
    needed_at_one = max(fixed + per_sample, floor_at(floor, 1))
    if failed is not None and failed[0] < 1:
        raise NoFeasiblePlanError(failed[1])
    _require_fits(size, needed_at_one, budget_bytes, capacity_bytes, margin)
    if size in peaks:  # the budget ends at a measured size: nothing was extrapolated
        note = (
            f"max micro-batch {size} read off the peaks measured up to {largest} for "
            f"capacity_bytes {capacity_bytes} with safety_margin {margin}"
        )
        return Limit(
            max_micro_batch_size=size,
            source=source,
            capacity_bytes=capacity_bytes,
            peak_bytes=lambda n: peaks.get(n),
            step_time=step_time,
            notes=(note, *_failure_note(failed, size)),
        )

    def peak_bytes(n: int) -> int:
        measured = interpolated_peak_bytes(peaks, n)
        return max(fixed + per_sample * n, floor_at(floor, n)) if measured is None else measured

    return Limit(
        max_micro_batch_size=size,
        source="estimated" if source == "estimated" else "predicted",
        capacity_bytes=capacity_bytes,
        peak_bytes=peak_bytes,
        step_time=step_time,
        notes=(prediction.describe(size), *_failure_note(failed, size)),
        prediction=prediction,
    )


def _predicted_size(
    profile: Profile, peaks: Mapping[int, int], budget_bytes: int, *, fits_measured: bool
) -> tuple[int, Prediction]:
    """The largest size the profile's line puts under ``budget_bytes`` for another capacity:
    past the measured sizes when some measured size fits (``fits_measured``), below them when
    none does; with only the stored line, past or below the profile's largest fitting size."""
    model = profile.memory_model
    largest = profile.max_micro_batch_size
    if fits_measured:
        return predict_past(
            peaks,
            budget_bytes=budget_bytes,
            stored=model,
            largest_measured_micro_batch_size=largest,
        )
    if peaks:
        return predict_below(peaks, budget_bytes=budget_bytes, stored=model)
    assert model is not None  # the caller refused a profile with neither
    if model.peak_bytes(largest) <= budget_bytes:
        return predict_past(
            peaks,
            budget_bytes=budget_bytes,
            stored=model,
            largest_measured_micro_batch_size=largest,
        )
    size, prediction = predict_below(
        peaks, budget_bytes=budget_bytes, stored=model, largest_measured_micro_batch_size=largest
    )
    return min(size, largest), prediction


def failure_limit(profile: Profile, budget_bytes: int) -> tuple[int, str] | None:
    """The largest micro-batch below every size that failed in ``profile`` and would fail again
    within ``budget_bytes``, and why; None when no failure bounds a plan for that budget.

    A size that ran out of memory peaked above the capacity it was tried at (the profile's
    ``capacity_bytes``), so no plan whose budget is no larger than that capacity may use it or
    anything larger, whatever the measured peaks or a line through them say (a line through
    gentle peaks can predict 32 where 11, 12, 24 and 47 ran out of memory). A failure other
    than memory (``failed_micro_batch_size``: a kernel's launch limit, say) does not move with
    the memory, so it bounds a plan for any budget; its note is the profile's ``failure_note``.
    A search that stopped at its boundary (``stop_kind`` ``"boundary"``, real trials: the size
    past ``max_micro_batch_size`` did not fit) bounds a plan for a budget no larger than its
    capacity at that maximum the same way: a smaller card (same model and conditions) is never
    planned past a bigger card's measured maximum, whatever its line predicts. A capped search,
    a confirmation or an estimate only says "at least", so it bounds nothing.

    Returns:
        ``(largest_allowed, note)``; ``largest_allowed`` is 0 when micro-batch 1 failed.
    """
    bounds: list[tuple[int, str]] = []
    ooms = [t.micro_batch_size for t in profile.trials if t.oom]
    if ooms and budget_bytes <= profile.capacity_bytes:
        smallest = min(ooms)
        bounds.append(
            (
                smallest - 1,
                f"micro-batch {smallest} ran out of memory in this profile at capacity_bytes "
                f"{profile.capacity_bytes}; this plan's budget ({budget_bytes} bytes) is no "
                f"larger, so no size from {smallest} up is planned, whatever the peaks predict",
            )
        )
    if _measured_boundary(profile) and budget_bytes <= profile.capacity_bytes:
        size = profile.max_micro_batch_size
        bounds.append(
            (
                size,
                f"micro-batch {size + 1} did not fit in this profile at capacity_bytes "
                f"{profile.capacity_bytes} (its measured maximum is {size}); this plan's budget "
                f"({budget_bytes} bytes) is no larger, so nothing past {size} is planned, "
                "whatever the peaks predict",
            )
        )
    if profile.failed_micro_batch_size:
        size = profile.failed_micro_batch_size
        bounds.append((size - 1, f"micro-batch {size} failed for a reason other than memory"))
    return min(bounds) if bounds else None


def _measured_boundary(profile: Profile) -> bool:
    """Whether ``profile``'s maximum is one real trials measured at its boundary: the next size
    did not fit (not a capped search, a confirmation of a prediction, or an estimate)."""
    return (
        profile.stop_kind == "boundary"
        and not profile.confirms_prediction
        and profile.method != "estimate"
        and profile.max_micro_batch_size > 0
    )


def _failure_note(failed: tuple[int, str] | None, size: int) -> tuple[str, ...]:
    """The note of an out-of-memory or measured-boundary bound that decided ``size`` (a failure
    other than memory is already in the plan's notes as the profile's ``failure_note``)."""
    if failed is None or failed[0] != size:
        return ()
    if "ran out of memory" not in failed[1] and "did not fit" not in failed[1]:
        return ()
    return (failed[1],)


def _require_fits(
    limit_size: int, needed_bytes: int, budget_bytes: int, capacity_bytes: int, margin: float
) -> None:
    if limit_size < 1:
        raise NoFeasiblePlanError(
            f"the model needs {format_bytes(needed_bytes)} ({needed_bytes} bytes) at micro-batch "
            "size 1, more than the "
            f"{format_bytes(budget_bytes)} usable of capacity_bytes {capacity_bytes} with "
            f"safety_margin {margin}; use a larger device, shard the model, or reduce its memory"
        )


def check_step_seconds(points: object, what: str) -> None:
    """Step times as the planner takes them: a mapping of two micro-batch sizes or more (ints
    >= 1) to finite seconds > 0.

    Raises:
        ConfigError: names ``what``, the value and the form expected.
    """
    if not isinstance(points, Mapping):
        raise ConfigError(
            f"{what} {points!r} must map micro-batch sizes to seconds, e.g. {{8: 0.1, 16: 0.18}}"
        )
    for size, value in points.items():
        require_int(f"{what} micro-batch size", size, 1)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)
        ):
            raise ConfigError(f"{what}[{size}] {value!r} must be finite seconds > 0")
    if len(points) < 2:
        raise ConfigError(f"{what} needs step times at two sizes or more, got {dict(points)}")


def _step_time_model(points: Mapping[int, float]) -> Callable[[int], float]:
    """Seconds per step at any micro-batch size, interpolated through measured points (checked
    by :func:`check_step_seconds`, or a profile's fitting trials).

    Piecewise linear through the points (with two points, the line ``a + b * m`` through them);
    beyond them the end segments extend, kept at least the smaller end's per-sample time below
    the smallest size, and non-decreasing above the largest. Not a least-squares line over all
    points: a line cannot show a step slowing down near the memory limit, and fitted to such
    points it predicts negative times at small sizes.
    """
    xs = sorted(points)
    ys = [float(points[x]) for x in xs]

    def seconds(size: int) -> float:
        i = min(max(bisect.bisect_right(xs, size) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        value = y0 + (y1 - y0) * (size - x0) / (x1 - x0)
        if size < xs[0]:
            return min(max(value, ys[0] * size / xs[0]), ys[0])
        if size > xs[-1]:
            return max(value, ys[-1])
        return value

    return seconds
