"""The probe's two option bundles, built and checked once at a public entry point and passed down:
:class:`StepSpec` (what the step is) and :class:`ProbeOptions` (how to probe it).

:func:`autobatch.probe` and :func:`autobatch.estimate` build these from their flat keyword
arguments, and the tuning road's :meth:`autobatch.tuning.TuneRequest.build` nests them in its
request (``step``, ``probe``); nothing below them checks an argument again.

Example::

    step = StepSpec.build(model, (inputs, targets), loss_fn=F.cross_entropy)
    options = ProbeOptions.build(step, device=resolve_device("sim:2GiB"))
    options.device.name, step.identity.model_fingerprint
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from autobatch.conditions import Conditions, launcher_world_size
from autobatch.device import Device
from autobatch.distributed import Consensus, LocalConsensus, collective_layout, data_parallel
from autobatch.errors import ConfigError
from autobatch.margin import DEFAULT_SAFETY_MARGIN, check_safety_margin
from autobatch.probing._batch import BatchSource
from autobatch.probing._compiled import CompiledMode, compiled_mode
from autobatch.probing._identity import step_identity
from autobatch.probing._live_conditions import activation_checkpointing, read_conditions
from autobatch.probing._parallel import device_for_layout
from autobatch.probing._placement import check_placement
from autobatch.probing._step import LossFn, TrainStep, check_step_arguments
from autobatch.profile import CheckpointingMode, GradientSync, Mode, StepIdentity, Trial

__all__ = [
    "DEFAULT_CLOCK",
    "DEFAULT_SEARCH_LIMIT",
    "MICRO_STEPS_WITHOUT_SYNC",
    "OnStage",
    "OnTrial",
    "ProbeOptions",
    "ProbeStage",
    "Stage",
    "StepSpec",
    "check_search_arguments",
    "measured_sync",
]

DEFAULT_SEARCH_LIMIT = 1 << 16
"""The search cap where the caller gives none: the largest micro-batch a search tries (the
public keyword ``max_micro_batch_size`` of ``autobatch.probe``/``autotune``, the CLI's
``autobatch tune --max-micro-batch-size``). High enough that a search ends at the card's
boundary, not here, for any model that fits at all; a search spends about log2 of it in
trials past an estimate, so a high cap costs little. The service's model registry caps its
probe runs lower (``service.probes.registry.REGISTRY_SEARCH_LIMIT``)."""

OnTrial = Callable[[Trial], None]
"""Called after each real trial (a progress display, the service's job log)."""

Stage = Literal["warm-up", "estimate", "trials", "confirm", "timing"]
"""A stage of a probe: the warm-up step (micro-batch 1, which creates the optimizer state), the
fake-tensor estimate (no real step; CPU time that can be long), the search's real trials, the
confirmation of the chosen size (its second step, or one trial at a predicted size), and the
timing of a plan's own micro-batch the search never ran (3 trials)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeStage:
    """A stage of a probe starting, for a progress display (:data:`OnStage`)."""

    stage: Stage
    max_trials: int
    """The most real trials the whole probe takes, the warm-up and the chosen size's second
    step included: ``ceil(log2(limit)) + 5`` for a search under ``limit``
    (:func:`autobatch.probing._search.trial_budget` plus those two), 2 for a confirmation. A
    display shows what is left of it (a bound, not a prediction)."""
    trials_run: int = 0
    """Real trials this probe ran before the stage (the warm-up included): what is left is
    ``max_trials`` less these and those run since."""
    checkpointing_mode: str = "none"
    """The activation checkpointing the probe runs under (``"none"``, ``"selective"``,
    ``"full"``): a display names it where several modes are probed."""


OnStage = Callable[[ProbeStage], None]
"""Called as each stage of a probe starts (a progress display)."""

DEFAULT_CLOCK: Callable[[], float] = time.perf_counter
"""The probe's clock (:attr:`ProbeOptions.clock`) where the caller gives none: seconds as they
pass. The one name a test patches to put the probes it makes through the public functions on
a set clock."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepSpec:
    """What the step is: the model, its micro-batches, and how a batch becomes a training step
    (docs/quickstart.md, "First runs from Python"). Build it with :meth:`build`."""

    model: torch.nn.Module
    sample: Any
    """The user's sample as given (a batch, a callable ``n -> batch``, a WorstCaseSample)."""
    source: BatchSource
    """Micro-batches of any size from ``sample``."""
    optimizer: torch.optim.Optimizer | None
    """The user's optimizer; None: the probe uses an AdamW of its own."""
    loss_fn: LossFn | None
    train_step: TrainStep | None
    step_includes_update: bool
    amp_dtype: torch.dtype | None
    identity: StepIdentity
    """What a profile of this step is stored under, taken before any step runs (a step that
    changes state, a call counter say, must not change the key its request looks up)."""
    model_name: str = ""
    """How the profile names the model (``Profile.model_name``); not part of the identity."""

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        sample: Any,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: LossFn | None = None,
        train_step: TrainStep | None = None,
        step_includes_update: bool = False,
        amp_dtype: torch.dtype | None = None,
        model_name: str | None = None,
    ) -> StepSpec:
        """Check the step's arguments and the sample, once. ``model_name``: how profiles name
        the model; None: its class (:func:`model_class_name`).

        Raises:
            ConfigError: a model that is not a Module, an optimizer over other parameters,
                ``step_includes_update`` without an optimizer, an autocast dtype that is not
                one, an empty or inconsistent sample (names the value and the fix).
        """
        check_step_arguments(
            model, optimizer, step_includes_update=step_includes_update, amp_dtype=amp_dtype
        )
        source = BatchSource.from_sample(sample)
        identity = step_identity(
            model,
            source,
            optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            amp_dtype=amp_dtype,
        )
        return cls(
            model=model,
            sample=sample,
            source=source,
            optimizer=optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            amp_dtype=amp_dtype,
            identity=identity,
            model_name=model_class_name(model) if model_name is None else model_name,
        )


_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def model_class_name(model: torch.nn.Module) -> str:
    """The class name of the model a user wrote: through ``torch.compile`` (``_orig_mod``) and
    DDP/FSDP wrappers (``module``), e.g. ``"GPT2LMHeadModel"``."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in _WRAPPERS:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return type(model).__name__
        model = inner


def check_search_arguments(search_limit: int, safety_margin: float) -> None:
    """The search's own arguments, checked once per probe or estimate: the search cap (the
    largest micro-batch tried) and the safety margin. The one range check of the search cap.

    Raises:
        ConfigError: names the argument as the caller typed it (the public keyword
            ``max_micro_batch_size``) and the accepted range.
    """
    check_safety_margin(safety_margin)
    if isinstance(search_limit, bool) or not isinstance(search_limit, int) or search_limit < 1:
        raise ConfigError(f"max_micro_batch_size {search_limit!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeOptions:
    """How to probe a step: on which device, within which margin and limit, agreed how across
    ranks, and what to report. Build it with :meth:`build`."""

    device: Device
    """The device probed (for a layout that needs it, the one :func:`device_for_layout` gives)."""
    safety_margin: float
    """Fraction of the capacity the recommended size keeps free, in [0, 1)."""
    search_limit: int
    """The search cap: the largest micro-batch the search tries (>= 1); the public keyword
    ``max_micro_batch_size`` maps to it in :meth:`build`. Not the measured maximum (the
    profile's ``max_micro_batch_size``)."""
    use_estimate: bool
    """Start from a fake-tensor estimate (False: doubling-then-bisect)."""
    on_trial: OnTrial | None
    eval: bool
    """Probe the evaluation micro-batch instead of the training one."""
    consensus: Consensus
    """How the ranks agree (:class:`LocalConsensus` for one process)."""
    layout: str
    """The model's collective layout (:func:`collective_layout`), "" for none."""
    compiled: CompiledMode
    """How a torch.compile'd model's step is measured (:func:`compiled_mode`)."""
    conditions: Conditions
    """The live process's conditions for the step on ``device``, read once before any step runs
    (:func:`~autobatch.probing._live_conditions.read_conditions`): what the lookup's key holds and
    what the profile records (with the optimizer state after its first step)."""
    gradient_sync: GradientSync = GradientSync()
    """The gradient-sync mode the trials run in (:func:`measured_sync`), recorded on the
    profile."""
    on_stage: OnStage | None = None
    """Called as each stage starts (:class:`ProbeStage`); set with ``dataclasses.replace`` by
    the tuning road from its ``on_stage`` option."""
    checkpointing_mode: CheckpointingMode = "none"
    """The activation checkpointing mode applied to the model while it is probed (recorded on
    the profile); the conditions name what recomputes (:meth:`under_checkpointing`)."""
    clock: Callable[[], float]
    """Seconds on a monotonic clock for the host's side of the probe: each fake step of the
    estimate and the estimate in all, which decide whether it starts and when it stops. Real
    steps are timed on the device's own clock (:meth:`autobatch.device.Device.clock`). Tests
    give a clock that advances by set amounts, so the road taken does not depend on how
    loaded the machine is."""

    @property
    def mode(self) -> Mode:
        return "eval" if self.eval else "train"

    @classmethod
    def build(
        cls,
        step: StepSpec,
        *,
        device: Device,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        search_limit: int = DEFAULT_SEARCH_LIMIT,
        use_estimate: bool = True,
        on_trial: OnTrial | None = None,
        eval: bool = False,
        consensus: Consensus | None = None,
        sourced_world_size: tuple[int, str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> ProbeOptions:
        """Check how to probe ``step`` on ``device`` (resolved by the caller), once, and read the
        conditions it runs under.

        ``sourced_world_size``: the data-parallel size and its source, as the caller resolved it
        (:func:`autobatch.distributed._layout.resolve_world_size`); None: the ranks probing
        together, else the launcher's ``WORLD_SIZE``, else one process. ``clock``: seconds for
        the estimate's timings (:attr:`clock`); None: :data:`DEFAULT_CLOCK`.

        Raises:
            ConfigError: a limit or margin no search can use, ``eval=True`` with a train_step
                that updates by itself, model and sample on another device than ``device``,
                or a parallel layout that cannot be probed here (see :func:`device_for_layout`).
        """
        check_search_arguments(search_limit, safety_margin)
        if eval and step.step_includes_update:
            raise _eval_of_an_updating_step()
        check_placement(step.model, step.source, device)
        layout = collective_layout(step.model)
        if layout:
            device = device_for_layout(
                device, layout, world_size=None if consensus is None else consensus.world_size
            )
        ranks = consensus if consensus is not None else LocalConsensus()
        if sourced_world_size is None:
            sourced_world_size = (
                (ranks.world_size, "the ranks probing together")
                if ranks.world_size > 1
                else launcher_world_size(os.environ) or (1, "one process")
            )
        return cls(
            device=device,
            safety_margin=safety_margin,
            search_limit=search_limit,
            use_estimate=use_estimate,
            on_trial=on_trial,
            eval=eval,
            consensus=ranks,
            layout=layout,
            compiled=compiled_mode(step.model, device.type),
            conditions=read_conditions(
                step.model,
                step.optimizer,
                device_type=device.type,
                amp_dtype=step.amp_dtype,
                sourced_world_size=sourced_world_size,
            ),
            gradient_sync=measured_sync(step, eval=eval),
            clock=DEFAULT_CLOCK if clock is None else clock,
        )

    def for_eval(self, step: StepSpec) -> ProbeOptions:
        """The same options for the evaluation micro-batch.

        Raises:
            ConfigError: ``step``'s train_step updates by itself (it cannot evaluate).
        """
        if step.step_includes_update:
            raise _eval_of_an_updating_step()
        return dataclasses.replace(self, eval=True, gradient_sync=measured_sync(step, eval=True))

    def under_checkpointing(self, step: StepSpec, mode: CheckpointingMode) -> ProbeOptions:
        """The same options for ``step``'s model as it is now, with activation checkpointing
        ``mode`` applied to it: the conditions' description read again (a key of its own)."""
        described = activation_checkpointing(step.model)
        return dataclasses.replace(
            self,
            checkpointing_mode=mode,
            conditions=dataclasses.replace(self.conditions, activation_checkpointing=described),
        )

    def with_limit(self, search_limit: int) -> ProbeOptions:
        """The same options with another search cap (checked)."""
        check_search_arguments(search_limit, self.safety_margin)
        return dataclasses.replace(self, search_limit=search_limit)


MICRO_STEPS_WITHOUT_SYNC = 2
"""Micro-steps per trial of a DDP or FSDP2 model: the first without the gradient reduction, as
a loop that reduces once per window runs it, so that the gradients held between micro-steps
(FSDP2's unsharded ones) are in the measured peak."""


def measured_sync(step: StepSpec, *, eval: bool) -> GradientSync:
    """The gradient-sync mode a probe of ``step`` measures in: for a training step of a DDP
    or FSDP2 model, two micro-steps, the reduction skipped on the first (as the Accumulator
    runs a window); no reduction to speak of for an evaluation or a plain model; not recorded
    for a ``train_step`` that updates by itself (it runs as written)."""
    parallel = None if eval else data_parallel(step.model, probing=True)
    if parallel is None:
        return GradientSync(mode="none")
    if step.step_includes_update:
        return GradientSync(mode="", wrapper=parallel.wrapper)
    return GradientSync(
        mode="once_per_window",
        wrapper=parallel.wrapper,
        num_micro_steps=MICRO_STEPS_WITHOUT_SYNC,
    )


def _eval_of_an_updating_step() -> ConfigError:
    return ConfigError(
        "eval=True runs a forward under inference_mode, but a train_step that updates by "
        "itself (step_includes_update=True) runs backward and steps the optimizer; pass "
        "an evaluation step that returns the loss (or output), with "
        "step_includes_update=False"
    )
