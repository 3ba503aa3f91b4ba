"""The choice of activation checkpointing with the micro-batch, PURE: measurements in, a mode
and its reasons out.

Two questions, each answered from what real trials measured under each mode:

- :func:`checkpointing_modes_to_try`: whether trying checkpointing can pay, from the plain
  (no checkpointing) plan alone. It cannot when the plain plan reaches the effective batch in one
  micro-step, nor when the time per sample measured at the plan's micro-batch is no longer
  falling (within :data:`FALLING_FRACTION` of the time per sample at half that size or less):
  a larger micro-batch then saves no time per sample, and checkpointing only adds recompute.
  Otherwise every mode is tried (each one probe, with the probe's bounded number of trials).
- :func:`choose_checkpointing`: among the modes measured, the one whose plan reaches the
  effective batch in the least time per optimizer step; a mode with less recompute wins when
  it is within the larger of :data:`SIGNIFICANT_FRACTION` and the measured noise of both times
  (:attr:`ModeMeasurement.seconds_noise`, :func:`timing_noise`: the spread of the steps timed
  at the plan's micro-batch) of the fastest (timings not significant), or when timings are
  missing. The plan-size timing (:func:`autobatch.probing.run_timing`) runs 3 steps after the
  warm-up (at most 4 trials more per mode), the fastest its time and their spread its noise;
  where the probe's search ran the plan's size, its steps there (the first and the second at
  the chosen size) give the spread; a time with no spread (one step, an older profile) is
  compared by the 5% rule alone. A mode whose measured peak memory is not below the plain
  one's at the same micro-batch (checkpointing that saved nothing, or raised the peak) is
  never chosen, nor one whose plan's micro-batch is no larger than a mode's with less
  recompute (only the recompute would differ: a faster time there is noise).

He and Yu (MLSys 2023, "Auto-Parallelization of Large-Scale Deep Learning Models") report a
geometric-mean +12% throughput from choosing checkpointing with the batch; torchtitan #97
measured selective against full checkpointing on Llama-7B at 4.55 against 4.91 s per iteration.

Example::

    plain = ModeMeasurement(mode="none", max_micro_batch_size=8, micro_batch_size=8,
                            gradient_accumulation_steps=8, seconds_per_optimizer_step=4.0,
                            peak_memory_bytes={8: 900})
    full = ModeMeasurement(mode="full", max_micro_batch_size=64, micro_batch_size=64,
                           gradient_accumulation_steps=1, seconds_per_optimizer_step=3.0,
                           peak_memory_bytes={8: 300, 64: 950})
    choose_checkpointing([plain, full]).mode          # "full"
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from autobatch.errors import ConfigError
from autobatch.profile import CheckpointingMode, Trial
from autobatch.units import format_bytes

__all__ = [
    "FALLING_FRACTION",
    "RECOMPUTE_ORDER",
    "SIGNIFICANT_FRACTION",
    "AskedCheckpointing",
    "CheckpointingChoice",
    "ModeMeasurement",
    "checkpointing_modes_to_try",
    "choose_checkpointing",
    "timing_noise",
]

AskedCheckpointing = Literal["auto", "none", "selective", "full"]
"""What a caller asks for: ``"auto"`` (choose among the modes by what was measured) or a mode."""

RECOMPUTE_ORDER: tuple[CheckpointingMode, ...] = ("none", "selective", "full")
"""The modes by recompute, least first (planning names them as strings; applying them is
:mod:`autobatch.probing._checkpointing`'s)."""

SIGNIFICANT_FRACTION = 0.05
"""Two times per optimizer step closer than 5% of the faster are never told apart, nor closer
than the measured noise of either (:attr:`ModeMeasurement.seconds_noise`) when that is larger:
on a busy host one step's time varies by a few percent, on a shared CPU by far more."""

FALLING_FRACTION = 0.05
"""Time per sample counts as still falling when the larger micro-batch's is more than 5% below
the smaller one's (the same noise as :data:`SIGNIFICANT_FRACTION`)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModeMeasurement:
    """What the probe under one checkpointing mode measured, and the plan it makes."""

    mode: CheckpointingMode
    """``"none"``, ``"selective"`` or ``"full"``."""
    max_micro_batch_size: int
    """The largest micro-batch that ran (0: not even 1 fits)."""
    micro_batch_size: int | None = None
    """The plan's micro-batch for the request under this mode; None: no plan."""
    gradient_accumulation_steps: int | None = None
    """The plan's accumulation steps; None: no plan."""
    seconds_per_optimizer_step: float | None = None
    """The plan's time per optimizer step from the measured step times, in seconds; None:
    no step time measured."""
    seconds_basis: str = ""
    """How ``seconds_per_optimizer_step`` was drawn when not from the planner's step times at
    two sizes or more (e.g. from the time per sample measured at one size, a bound); empty when
    it was, or when no time was measured."""
    seconds_noise: float = 0.0
    """The measured noise of ``seconds_per_optimizer_step``, a fraction of it: (median -
    fastest) / fastest over the steps timed at the plan's micro-batch (0.25: the median step
    took 25% longer than the fastest); 0.0 when one step or none was timed there (then the
    :data:`SIGNIFICANT_FRACTION` rule alone)."""
    peak_memory_bytes: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Measured peak memory (bytes) of each micro-batch that ran and fitted."""
    num_trials: int = 0
    """Real trials the mode's probe ran (0 for a stored profile)."""

    def __post_init__(self) -> None:
        if self.mode not in RECOMPUTE_ORDER:
            raise ConfigError(
                f"activation checkpointing mode={self.mode!r} is not a mode; give one of "
                f"{', '.join(repr(m) for m in RECOMPUTE_ORDER)}"
            )
        if not self.seconds_noise >= 0.0:
            raise ConfigError(
                f"seconds_noise={self.seconds_noise!r} must be a fraction >= 0 (0.0: no "
                "spread measured)"
            )

    @property
    def has_plan(self) -> bool:
        return self.micro_batch_size is not None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointingChoice:
    """The mode chosen and why, with a line per mode measured."""

    mode: CheckpointingMode
    """The chosen mode."""
    reason: str
    """Why it won, in words."""
    considered: tuple[str, ...] = ()
    """One line per mode measured: its plan and time, or why it was left out."""


def timing_noise(trials: Iterable[Trial], micro_batch_size: int) -> float:
    """The measured noise of the time at ``micro_batch_size``: (median - fastest) / fastest
    over the steps of ``trials`` timed there (fitted, not the warm-up, ``step_seconds`` > 0),
    a fraction (0.5: the median step took half as long again as the fastest); 0.0 with fewer
    than two such steps. :attr:`ModeMeasurement.seconds_noise` takes it."""
    times = sorted(
        trial.step_seconds
        for trial in trials
        if trial.micro_batch_size == micro_batch_size
        and trial.fits
        and not trial.warm_up
        and trial.step_seconds > 0
    )
    if len(times) < 2:
        return 0.0
    return (statistics.median(times) - times[0]) / times[0]


def checkpointing_modes_to_try(
    plain: ModeMeasurement, seconds_per_sample: Mapping[int, float]
) -> tuple[tuple[CheckpointingMode, ...], str]:
    """The checkpointing modes worth probing besides the plain one, and why.

    Args:
        plain: the plain (``"none"``) measurement with its plan.
        seconds_per_sample: measured step seconds / micro-batch, by micro-batch that fitted.

    Returns:
        ``(modes, reason)``: ``("selective", "full")`` or ``()``, and the reason in words.
    """
    everything = RECOMPUTE_ORDER[1:]
    if not plain.has_plan or plain.max_micro_batch_size == 0:
        return everything, "no micro-batch fits without checkpointing"
    size, steps = plain.micro_batch_size, plain.gradient_accumulation_steps
    assert size is not None and steps is not None
    if steps == 1:
        return (), (
            f"the plan without checkpointing reaches the effective batch in one micro-step "
            f"(micro-batch {size}): checkpointing could only add recompute"
        )
    if plain.seconds_per_optimizer_step is None:
        # choose_checkpointing keeps the least recompute that fits while any mode is untimed:
        # with the plain plan untimed no other mode could win, so none is tried in vain.
        return (), (
            f"the plan without checkpointing (micro-batch {size}) has no measured step time, "
            "so no mode could be shown faster: the least recompute that fits"
        )
    smaller = [n for n in seconds_per_sample if n <= size // 2]
    if size not in seconds_per_sample or not smaller:
        return everything, (
            f"time per sample was not measured at two sizes up to micro-batch {size}, so "
            "whether a larger micro-batch saves time is not known"
        )
    half = max(smaller)
    at_size, at_half = seconds_per_sample[size], seconds_per_sample[half]
    if at_size >= at_half * (1 - FALLING_FRACTION):
        return (), (
            f"time per sample stopped falling without checkpointing: {at_size:.3g} s at "
            f"micro-batch {size} against {at_half:.3g} s at {half} (measured), so a larger "
            "micro-batch would save no time"
        )
    return everything, (
        f"time per sample still falls without checkpointing ({at_size:.3g} s at "
        f"micro-batch {size} against {at_half:.3g} s at {half}, measured)"
    )


def _saves_memory(mode: ModeMeasurement, plain: ModeMeasurement | None) -> str:
    """Why ``mode`` saves no memory against ``plain`` (``""`` when it does)."""
    if plain is None or mode.mode == "none" or plain.max_micro_batch_size == 0:
        return ""
    common = sorted(set(mode.peak_memory_bytes) & set(plain.peak_memory_bytes))
    if common:
        size = common[-1]
        ours, theirs = mode.peak_memory_bytes[size], plain.peak_memory_bytes[size]
        if ours >= theirs:
            return (
                f"its measured peak memory at micro-batch {size} ({format_bytes(ours)}) is not "
                f"below the plain one's ({format_bytes(theirs)})"
            )
        return ""
    if mode.max_micro_batch_size <= plain.max_micro_batch_size:
        return (
            f"its largest micro-batch ({mode.max_micro_batch_size}) is not above the plain "
            f"one's ({plain.max_micro_batch_size})"
        )
    return ""


def _no_larger(mode: ModeMeasurement, less_recompute: Sequence[ModeMeasurement]) -> str:
    """Why ``mode``'s plan gains nothing over a mode with less recompute (``""`` when it does):
    a micro-batch no larger than theirs means the same steps or more, plus the recompute."""
    if not less_recompute:
        return ""
    best = max(less_recompute, key=lambda m: m.micro_batch_size or 0)
    size, theirs = mode.micro_batch_size or 0, best.micro_batch_size or 0
    if size > theirs:
        return ""
    return (
        f"its plan's micro-batch {size} is no larger than {best.mode}'s ({theirs}): "
        "only more recompute"
    )


def _line(mode: ModeMeasurement) -> str:
    seconds = mode.seconds_per_optimizer_step
    timing = "time not measured" if seconds is None else f"{seconds:.4g} s per optimizer step"
    if seconds is not None and mode.seconds_basis:
        timing += f" ({mode.seconds_basis})"
    if seconds is not None and mode.seconds_noise > 0:
        timing += f", measured noise {mode.seconds_noise:.0%}"
    steps = mode.gradient_accumulation_steps
    return (
        f"{mode.mode}: micro-batch {mode.micro_batch_size} \u00d7 {steps} "
        f"step{'' if steps == 1 else 's'}, {timing} (largest micro-batch "
        f"{mode.max_micro_batch_size}, {mode.num_trials} trials)"
    )


def choose_checkpointing(measured: Sequence[ModeMeasurement]) -> CheckpointingChoice | None:
    """The mode to train with among ``measured`` (see the module docstring); None when no
    mode has a plan.

    Args:
        measured: one measurement per mode probed (the plain one included when it ran).
    """
    plain = next((m for m in measured if m.mode == "none"), None)
    considered: list[str] = []
    eligible: list[ModeMeasurement] = []
    for mode in sorted(measured, key=lambda m: RECOMPUTE_ORDER.index(m.mode)):
        if not mode.has_plan:
            considered.append(
                f"{mode.mode}: no plan (largest micro-batch {mode.max_micro_batch_size})"
            )
            continue
        in_vain = _saves_memory(mode, plain) or _no_larger(mode, eligible)
        if in_vain:
            considered.append(f"{mode.mode}: left out, {in_vain}")
            continue
        considered.append(_line(mode))
        eligible.append(mode)
    if not eligible:
        return None
    if len(eligible) == 1:
        only = eligible[0].mode
        reason = (
            f"the only mode tried ({only})"
            if len(measured) == 1
            else f"the only mode whose plan is worth its recompute ({only}; the others: below)"
        )
        return CheckpointingChoice(mode=only, reason=reason, considered=tuple(considered))
    timed = [m for m in eligible if m.seconds_per_optimizer_step is not None]
    if len(timed) < len(eligible) or not timed:
        return CheckpointingChoice(
            mode=eligible[0].mode,
            reason="step times were not measured for every mode: the least recompute that fits",
            considered=tuple(considered),
        )
    fastest = min(timed, key=lambda m: m.seconds_per_optimizer_step or 0.0)
    best = fastest.seconds_per_optimizer_step or 0.0
    for mode in eligible:  # least recompute first
        seconds = mode.seconds_per_optimizer_step or 0.0
        margin, which = _margin(mode, fastest)
        if seconds <= best * (1 + margin):
            if mode is fastest:
                reason = f"the least time per optimizer step ({seconds:.4g} s)"
            else:
                reason = (
                    f"within {which} of the fastest ({fastest.mode}, {best:.4g} s against "
                    f"{seconds:.4g} s): not significant, so the least recompute wins"
                )
            return CheckpointingChoice(mode=mode.mode, reason=reason, considered=tuple(considered))
    raise AssertionError("the fastest mode is within its own time")  # pragma: no cover


def _margin(mode: ModeMeasurement, fastest: ModeMeasurement) -> tuple[float, str]:
    """The fraction within which ``mode``'s time is not told from ``fastest``'s, and in words
    which decided: :data:`SIGNIFICANT_FRACTION`, or the larger measured noise of the two."""
    noise = max(mode.seconds_noise, fastest.seconds_noise)
    if noise > SIGNIFICANT_FRACTION:
        return noise, f"the measured noise of {noise:.0%}"
    return SIGNIFICANT_FRACTION, f"{SIGNIFICANT_FRACTION:.0%}"
