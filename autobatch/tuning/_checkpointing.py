"""The tuning road's activation checkpointing: the mode asked for (:class:`CheckpointingRequest`),
the probe under each mode, and the choice among them.

- ``"none"`` (the default): the model as given; when not even micro-batch 1 fits and the model
  has repeated blocks, one more probe under ``"full"`` checkpointing names the plan that would
  fit in the error, with the remedy ``activation_checkpointing="auto"``.
- ``"selective"`` or ``"full"``: the probe and the plan under that mode.
- ``"auto"``: the plain probe first; then, unless trying cannot pay
  (:func:`autobatch.planning.checkpointing_modes_to_try`: one micro-step, or time per sample no
  longer falling, measured), one probe per mode (``"selective"``, ``"full"``), each bounded as
  every probe is; the choice is :func:`autobatch.planning.choose_checkpointing`'s. Each mode's
  plan has its own micro-batch timed: where the probe's search never ran that size, 3 real
  trials more run it (after a warm-up step), the fastest its time and their spread its
  measured noise, so the choice compares times measured at each plan's micro-batch and tells
  them apart only beyond that noise. At most two probes more than without ``"auto"``, and at
  most 4 trials more per mode.

Every probe under a mode applies it to the model's blocks and undoes it when it is done
(:func:`autobatch.probing.activation_checkpointing_applied`): the model's modules are the same
objects with the same state afterwards. Each mode's profile has a key of its own (the
conditions name what recomputes), so a profile of one mode never answers for another.

Example::

    found, plan, outcome = tune_checkpointing(request, options, planned)
    outcome.chosen, outcome.tried, outcome.why_tried
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, get_args

import torch

from autobatch.errors import (
    AutobatchError,
    ConfigError,
    DoesNotFitError,
    NoFeasiblePlanError,
    Remedy,
)
from autobatch.planning import (
    AskedCheckpointing,
    ModeMeasurement,
    Plan,
    checkpointing_modes_to_try,
    choose_checkpointing,
    mode_report,
    timing_noise,
)
from autobatch.probing import (
    CHECKPOINTING_MODES,
    ProbeOptions,
    activation_checkpointing_applied,
    checkpointable_blocks,
    checkpointed_blocks,
    run_timing,
)
from autobatch.profile import CheckpointingMode, Profile, Trial
from autobatch.tuning._cache import TunedProfile
from autobatch.tuning._lookup import find_profile

if TYPE_CHECKING:
    from autobatch.tuning._request import TuneRequest

__all__ = [
    "ASKED_MODES",
    "CheckpointingOutcome",
    "CheckpointingRequest",
    "ModeRun",
    "tune_checkpointing",
]

ASKED_MODES: tuple[AskedCheckpointing, ...] = get_args(AskedCheckpointing)
"""What ``activation_checkpointing`` takes: ``"auto"`` (choose by real trials) or a mode."""

PlanOf = Callable[[TunedProfile], Plan]
"""How the road plans from a found profile (its budget and source)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointingRequest:
    """The activation checkpointing asked for, checked once by :meth:`build`."""

    mode: str = "none"
    """``"none"`` (the model as given), ``"selective"``, ``"full"`` or ``"auto"``."""
    block_class: type[torch.nn.Module] | str | None = None
    """The class (or class name) of the blocks to checkpoint; None: found."""
    no_blocks: str = ""
    """Under ``"auto"`` with no block class given: why the model has no blocks to checkpoint
    (then only the model as given is probed, and the plan says why); empty when it has."""

    @classmethod
    def build(
        cls, model: torch.nn.Module, mode: str, block_class: type[torch.nn.Module] | str | None
    ) -> CheckpointingRequest:
        """The request, with its blocks found now when a mode other than ``"none"`` may apply
        or a block class is given (under ``"none"`` it names the blocks of the checkpointed
        plan a does-not-fit error offers, so a class that matches nothing is refused whatever
        the mode: a typo never goes unnoticed).

        Raises:
            ConfigError: an unknown mode, no blocks to checkpoint (names
                ``checkpoint_block_class``), or a mode other than ``"none"`` asked of a model
                autobatch already checkpoints (refused before any step runs).
        """
        if mode not in ASKED_MODES:
            raise ConfigError(
                f"activation_checkpointing={mode!r} is not a choice; give one of "
                f"{', '.join(repr(m) for m in ASKED_MODES)}"
            )
        applied = checkpointed_blocks(model)
        if mode != "none" and applied:
            raise ConfigError(
                f"activation_checkpointing={mode!r}: the model already has autobatch's "
                f"activation checkpointing applied to {applied} blocks, so no mode could be "
                "probed as asked; call the undo apply_activation_checkpointing returned (or "
                "autobatch.probing.remove_activation_checkpointing(model)) first, or give "
                "activation_checkpointing='none' to plan the model as it is"
            )
        if mode != "none" or block_class is not None:
            try:
                checkpointable_blocks(model, block_class=block_class)
            except ConfigError as exc:
                why = str(exc).replace("block_class=", "checkpoint_block_class=")
                if mode == "auto" and block_class is None:  # asked for, never imposed
                    return cls(mode=mode, no_blocks=why)
                raise ConfigError(why) from None
        return cls(mode=mode, block_class=block_class)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModeRun:
    """One mode's probe and plan, or why it has none."""

    mode: CheckpointingMode
    found: TunedProfile | None = None
    plan: Plan | None = None
    error: AutobatchError | None = None
    """Why no plan (not even micro-batch 1 fits, or no split meets the constraints)."""
    timing: tuple[Trial, ...] = ()
    """The trials that timed the plan's own micro-batch where the probe never ran it (the
    warm-up first, the timed trials last); empty when the probe's trials had it timed."""
    seconds: float = 0.0
    """Seconds the mode's probe and timing took, on the probe's host clock
    (:attr:`autobatch.probing.ProbeOptions.clock`): a stored profile's read takes almost none."""

    @property
    def num_trials(self) -> int:
        """Real trials run now for this mode: its probe's (none for a stored profile) and the
        timing's; 0 where no micro-batch fits (the trials went with the error)."""
        probed = 0
        if self.found is not None and not self.found.cached:
            probed = len(self.found.profile.trials)
        return probed + len(self.timing)

    @property
    def profile(self) -> Profile | None:
        return None if self.found is None else self.found.profile


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointingOutcome:
    """What ``activation_checkpointing="auto"`` tried and chose."""

    chosen: str
    """The mode the plan trains with."""
    reason: str
    """Why it won."""
    tried: tuple[str, ...]
    """The modes probed, ``"none"`` first."""
    why_tried: str
    """Why the other modes were or were not probed."""
    considered: tuple[str, ...]
    """One line per mode probed: its plan and time, or why it was left out."""
    runs: tuple[ModeRun, ...]
    """Each mode's profile and plan (the report draws them)."""

    def probe_time(self) -> str:
        """Every mode's probe time and trials, e.g. ``"31.2 s over 3 modes: none 9.8 s (6
        trials), selective 10.1 s (6 trials), full 11.3 s (6 trials)"``."""
        return _probe_time(self.runs)

    def notes(self) -> list[str]:
        """The plan's notes: the choice, what was tried and why, each mode's line."""
        skipped = [m for m in CHECKPOINTING_MODES if m not in self.tried]
        tried = f"tried {', '.join(self.tried)}"
        if skipped:
            tried += f"; skipped {', '.join(skipped)}"
        return [
            f"activation checkpointing {self.chosen}: {self.reason}",
            f"activation checkpointing modes {tried}: {self.why_tried}",
            *(f"activation checkpointing {line}" for line in self.considered),
        ]


def _probe_time(runs: tuple[ModeRun, ...] | list[ModeRun]) -> str:
    total = sum(run.seconds for run in runs)
    modes = "mode" if len(runs) == 1 else "modes"
    each = ", ".join(
        f"{run.mode} {run.seconds:.3g} s"
        + (f" ({run.num_trials} trials)" if run.found is not None else " (nothing fits)")
        for run in runs
    )
    return f"{total:.3g} s over {len(runs)} {modes}: {each}"


def tune_checkpointing(
    request: TuneRequest, options: ProbeOptions, planned: PlanOf
) -> tuple[TunedProfile, Plan, CheckpointingOutcome | None]:
    """The profile and plan for ``request`` under the activation checkpointing it asks for
    (see the module docstring), with what ``"auto"`` tried (None for a fixed mode).

    Raises:
        DoesNotFitError: not even micro-batch 1 fits under the mode asked; without
            checkpointing asked, names the checkpointed plan that fits (when one does) and the
            remedy ``activation_checkpointing="auto"``.
        NoFeasiblePlanError, ConfigError, StepFailedError, StoreError, DistributedError: as
            :func:`autobatch.autotune`.
    """
    mode = request.checkpointing.mode
    if mode == "auto":
        return _auto(request, options, planned)
    if mode in ("selective", "full"):
        found = _probe_under(request, options, "full" if mode == "full" else "selective")
        return found, planned(found), None
    try:
        found = find_profile(request.step, options, request.store)
    except DoesNotFitError as exc:
        raise _naming_checkpointed_plan(exc, request, options, planned) from exc
    return found, planned(found), None


def _probe_under(
    request: TuneRequest, options: ProbeOptions, mode: CheckpointingMode
) -> TunedProfile:
    """The profile of ``request``'s step with ``mode`` applied, undone afterwards."""
    step = request.step
    if mode == "none":
        return find_profile(step, options, request.store)
    asked = request.checkpointing
    with activation_checkpointing_applied(step.model, mode, block_class=asked.block_class):
        return find_profile(step, options.under_checkpointing(step, mode), request.store)


def _run(
    request: TuneRequest, options: ProbeOptions, mode: CheckpointingMode, planned: PlanOf
) -> ModeRun:
    """``mode``'s probe and plan; a mode where nothing fits or no split works has an error."""
    try:
        found = _probe_under(request, options, mode)
    except DoesNotFitError as exc:
        return ModeRun(mode=mode, error=exc)
    try:
        return ModeRun(mode=mode, found=found, plan=planned(found))
    except NoFeasiblePlanError as exc:
        return ModeRun(mode=mode, found=found, error=exc)


def _timed(request: TuneRequest, options: ProbeOptions, run: ModeRun, *, floor: int = 0) -> ModeRun:
    """``run`` with its plan's own micro-batch timed by 3 real trials (and the warm-up that
    creates the optimizer state) under its mode, where no trial of its probe timed that size:
    the choice among modes compares times measured at each plan's micro-batch, never bounds.
    Not where the plan's micro-batch is no larger than ``floor`` (the plain plan's): such a
    mode is never chosen, whatever its time."""
    plan = run.plan
    if plan is None or plan.micro_batch_size <= floor:
        return run
    if plan.micro_batch_size in seconds_per_sample(run.profile):
        return run
    step, asked = request.step, request.checkpointing
    with (
        activation_checkpointing_applied(step.model, run.mode, block_class=asked.block_class)
        if run.mode != "none"
        else contextlib.nullcontext()
    ):
        under = options if run.mode == "none" else options.under_checkpointing(step, run.mode)
        trials = run_timing(step, under, micro_batch_size=plan.micro_batch_size)
    return dataclasses.replace(run, timing=tuple(trials))


def _measurement(run: ModeRun) -> ModeMeasurement:
    """What ``run`` measured, as the pure choice takes it."""
    profile = run.profile
    if profile is None:
        return ModeMeasurement(mode=run.mode, max_micro_batch_size=0)
    peaks: dict[int, int] = {}
    for trial in (*profile.trials, *run.timing):
        if trial.fits and not trial.warm_up:
            size = trial.micro_batch_size
            peaks[size] = max(peaks.get(size, 0), trial.peak_allocated_bytes)
    plan = run.plan
    seconds, basis = (None, "") if plan is None else _step_seconds(plan, _run_seconds(run))
    return ModeMeasurement(
        mode=run.mode,
        max_micro_batch_size=profile.max_micro_batch_size,
        micro_batch_size=None if plan is None else plan.micro_batch_size,
        gradient_accumulation_steps=None if plan is None else plan.gradient_accumulation_steps,
        seconds_per_optimizer_step=seconds,
        seconds_basis=basis,
        seconds_noise=0.0
        if plan is None or seconds is None
        else timing_noise((*profile.trials, *run.timing), plan.micro_batch_size),
        peak_memory_bytes=peaks,
        num_trials=len(run.timing)
        + (0 if run.found is None or run.found.cached else len(profile.trials)),
    )


def _run_seconds(run: ModeRun) -> dict[int, float]:
    """:func:`seconds_per_sample` of ``run``'s profile with its timing trial's beside them."""
    found = seconds_per_sample(run.profile)
    for trial in run.timing:
        if trial.fits and not trial.warm_up and trial.step_seconds > 0:
            per_sample = trial.step_seconds / trial.micro_batch_size
            size = trial.micro_batch_size
            found[size] = min(found.get(size, per_sample), per_sample)
    return found


def _step_seconds(plan: Plan, measured: dict[int, float]) -> tuple[float | None, str]:
    """Seconds per optimizer step of ``plan`` and how they were drawn (``""``: measured at the
    plan's own micro-batch, or the planner's).

    From the time per sample measured at the plan's micro-batch (:func:`_timed` sees to it
    that it was) times the plan's samples per rank; else the planner's, from the step times
    measured at two sizes or more; else from the measured time per sample at one size: at the
    largest size that ran below the plan's micro-batch (above it time per sample falls or
    stays, so a bound from above), else at the smallest above it (a bound from below); None
    only when no size was timed.
    """
    samples = sum(plan.micro_batch_sizes)
    if plan.micro_batch_size in measured:
        bound = "" if set(plan.micro_batch_sizes) == {plan.micro_batch_size} else "at most: "
        return measured[plan.micro_batch_size] * samples, (
            f"{bound}measured at micro-batch {plan.micro_batch_size}" if bound else ""
        )
    if plan.predicted_seconds_per_effective_batch is not None:
        return plan.predicted_seconds_per_effective_batch, ""
    if not measured:
        return None, ""
    below = [size for size in measured if size <= plan.micro_batch_size]
    if below:
        size = max(below)
        bound = "at most: "
    else:
        size = min(measured)
        bound = "at least: "
    return measured[size] * samples, (
        f"{bound}from the time per sample measured at micro-batch {size}"
    )


def seconds_per_sample(profile: Profile | None) -> dict[int, float]:
    """Measured step seconds per sample by micro-batch that fitted (the least of repeats): the
    times the report plots (:func:`autobatch.planning.mode_report`), read from it."""
    found: dict[int, float] = {}
    if profile is None:
        return found
    for trial in mode_report(profile.activation_checkpointing, profile)["trials"]:
        per_sample = trial["seconds_per_sample"]
        if per_sample is not None:
            size = trial["micro_batch_size"]
            found[size] = min(found.get(size, per_sample), per_sample)
    return found


def _auto(
    request: TuneRequest, options: ProbeOptions, planned: PlanOf
) -> tuple[TunedProfile, Plan, CheckpointingOutcome]:
    runs: list[ModeRun] = []

    def measured(mode: CheckpointingMode) -> ModeRun:
        started = options.clock()
        # The plain plan is always eligible: a mode no larger than it is never chosen.
        floor = runs[0].plan.micro_batch_size if runs and runs[0].plan else 0
        run = _timed(request, options, _run(request, options, mode, planned), floor=floor)
        return dataclasses.replace(run, seconds=options.clock() - started)

    runs.append(measured("none"))
    plain = _measurement(runs[0])
    modes, why = checkpointing_modes_to_try(plain, _run_seconds(runs[0]))
    if request.checkpointing.no_blocks:
        modes, why = (), f"nothing to checkpoint: {request.checkpointing.no_blocks}"
    for mode in modes:
        runs.append(measured(mode))
    choice = choose_checkpointing([_measurement(run) for run in runs])
    if choice is None:
        raise _none_planned(runs, why)
    chosen = next(run for run in runs if run.mode == choice.mode)
    assert chosen.found is not None and chosen.plan is not None
    reason = choice.reason
    if request.checkpointing.no_blocks:
        reason = "the model has no repeated blocks to checkpoint, so only none was tried"
    outcome = CheckpointingOutcome(
        chosen=choice.mode,
        reason=reason,
        tried=tuple(run.mode for run in runs),
        why_tried=why,
        considered=choice.considered,
        runs=tuple(runs),
    )
    return chosen.found, chosen.plan, outcome


def _none_planned(runs: list[ModeRun], why: str) -> AutobatchError:
    """The error of the last mode without a plan, saying every mode ``"auto"`` tried and why
    each has none (or why the others were not tried)."""
    error = next((run.error for run in reversed(runs) if run.error is not None), None)
    assert error is not None, "a mode without a plan has its error"
    if len(runs) == 1:
        tried = f"activation checkpointing 'auto' tried none alone: {why}"
    else:
        each = "; ".join(
            f"{run.mode}: "
            + (
                "not even micro-batch 1 fits"
                if isinstance(run.error, DoesNotFitError)
                else "no split of the effective batch meets the constraints"
            )
            for run in runs
        )
        tried = (
            f"activation checkpointing 'auto' tried {', '.join(run.mode for run in runs)} "
            f"({_probe_time(runs)}) and no mode plans: {each}"
        )
    # The same error (its kind and fields: a caller may read capacity_bytes), the message told.
    error.args = (f"{error.message}; {tried}", *error.args[1:])
    return error


def _naming_checkpointed_plan(
    exc: DoesNotFitError, request: TuneRequest, options: ProbeOptions, planned: PlanOf
) -> DoesNotFitError:
    """``exc`` naming the plan under full checkpointing that fits, when the model has blocks
    to checkpoint and one does (one more probe, undone afterwards); else ``exc``."""
    model = request.step.model
    try:
        checkpointable_blocks(model, block_class=request.checkpointing.block_class)
    except ConfigError:
        return exc
    run = _run(request, options, "full", planned)
    if run.plan is None:
        return exc
    plan = run.plan
    return DoesNotFitError(
        f"{exc.message}; with activation checkpointing 'full' it fits: micro_batch_size "
        f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps} accumulation steps "
        f"(largest micro-batch {plan.max_micro_batch_size}, measured)",
        device_name=exc.device_name,
        capacity_bytes=exc.capacity_bytes,
        required_bytes=exc.required_bytes,
        static_bytes=exc.static_bytes,
        remedies=(
            Remedy(
                parameter="activation_checkpointing",
                values=("auto",),
                purpose="choose activation checkpointing with the micro-batch",
            ),
            *exc.remedies,
        ),
    )
