"""What the framework drop-ins share: checking the probe options a user passes through, the
framework's own step as a ``train_step`` with a stable identity, and one call to
:func:`autobatch.autotune` that plans equal micro-batches and an exact effective batch.

Example::

    check_options(options, caller="AutobatchFinder", owned=SET_BY_FRAMEWORK | STEP_ARGUMENTS)
    step = FrameworkStep(lambda model, batch: model.training_step(batch, 0),
                         identity=code_identity(type(module).training_step))
    plan = tune(module, sample, effective_batch_size=64, world_size=1, optimizer=optimizer,
                train_step=step, device="sim:1GiB", amp_dtype=None, options=options,
                caller="AutobatchFinder")
    plan = with_epoch(plan, len(dataset), drop_last=False, caller="AutobatchFinder",
                      last_step="Lightning steps with what is left")
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from autobatch.device import Device
from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import Plan
from autobatch.probing import (
    apply_activation_checkpointing,
    callable_identity,
    checkpointed_blocks,
)
from autobatch.tuning import (
    TuneOptions,
    TuneRequest,
    largest_request,
    tune_largest,
    tune_request,
)

__all__ = [
    "FrameworkStep",
    "check_checkpointing_asked",
    "check_options",
    "checkpoint_for_training",
    "code_identity",
    "dataset_rows",
    "refuse_deepspeed",
    "tune",
    "with_epoch",
]

logger = logging.getLogger("autobatch.integrations")

SET_BY_FRAMEWORK = frozenset(
    {
        "model",
        "sample",
        "effective_batch_size",
        "world_size",
        "optimizer",
        "uneven",
        "allow_inexact",
    }
)
"""autotune arguments every drop-in derives from the framework; a user may not pass them."""

STEP_ARGUMENTS = frozenset({"loss_fn", "train_step", "step_includes_update"})
"""How a sample becomes a step: the drop-ins that run the framework's own step set these too."""

_FRAMEWORKS = {
    "AutobatchFinder": "Lightning",
    "autotune_trainer": "the Hugging Face Trainer",
    "autotune_accelerator": "Accelerate",
}
"""Each drop-in's framework, by the drop-in's name, for what the framework cannot run."""

_NEVER_OFFERED = frozenset({"allow_inexact", "uneven"})
"""Planner remedies no drop-in takes: it keeps the effective batch exact, one micro-batch size."""


def check_options(
    options: Mapping[str, Any], *, caller: str, owned: frozenset[str] = SET_BY_FRAMEWORK
) -> None:
    """Refuse probe options that :func:`autobatch.autotune` does not take, or that the drop-in
    sets itself from the framework (``owned``: the model, the world size...).

    Raises:
        ConfigError: names the option and what to do instead; ``mixed_ranks=True``, which no
            framework behind a drop-in can run (a micro-batch per rank), names the framework.
    """
    accepted = {"model", "sample", "effective_batch_size", *TuneOptions.__annotations__} - owned
    for name in options:
        if name in owned:
            raise ConfigError(
                f"{caller} sets {name!r} itself from the framework (the model, its own training "
                "step and optimizer, the world size, equal micro-batches and an exact effective "
                f"batch); remove {name}=... or call autobatch.autotune directly"
            )
        if name not in accepted:
            raise ConfigError(
                f"{caller} got an unknown probe option {name!r}; the options are "
                f"{sorted(accepted)} (see autobatch.autotune)"
            )
    if options.get("mixed_ranks"):
        framework = _FRAMEWORKS.get(caller, "the framework")
        raise ConfigError(
            f"{caller} cannot run mixed_ranks=True: {framework} gives every rank one "
            "micro-batch size (one DataLoader batch size, a sampler of equal shares) and "
            "averages the ranks' gradients with equal weights, so a micro-batch per rank would "
            "change the effective batch and the gradient; run a mixed plan in your own loop "
            "(autobatch.autotune(mixed_ranks=True), autobatch.training.MixedBatchSampler and "
            "the Accumulator), or leave mixed_ranks unset"
        )


def check_checkpointing_asked(
    model: torch.nn.Module, options: Mapping[str, Any], *, caller: str, already: str = ""
) -> str:
    """The activation checkpointing mode asked in ``options`` (``"none"`` when not asked),
    refused when the model checkpoints already: the probe would measure both at once, and the
    drop-in could not switch the framework's on for the mode chosen.

    Args:
        already: the framework's own switch, when it is on (e.g.
            ``"TrainingArguments(activation_checkpointing=True)"``); empty when off.

    Raises:
        ConfigError: a mode other than ``"none"`` asked of a model with checkpointing on
            (autobatch's blocks, Hugging Face's flags, or ``already``), naming the fix.
    """
    asked = str(options.get("activation_checkpointing", "none"))
    if asked == "none":
        return asked
    wrapped = checkpointed_blocks(model)
    flagged = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    on = (
        already
        or (f"autobatch checkpoints {wrapped} of its blocks" if wrapped else "")
        or ("its modules' gradient_checkpointing flags are on" if flagged else "")
    )
    if on:
        raise ConfigError(
            f"{caller} got activation_checkpointing={asked!r}, but the model checkpoints "
            f"activations already ({on}), so the probe would measure both; turn that off "
            "(autobatch.probing.remove_activation_checkpointing(model), "
            "model.activation_checkpointing_disable(), or the framework's switch) to let "
            f"{caller} choose, or leave activation_checkpointing out to plan the model as it is"
        )
    return asked


def checkpoint_for_training(
    model: torch.nn.Module, plan: Plan, options: Mapping[str, Any]
) -> Callable[[], None]:
    """Apply ``plan``'s activation checkpointing mode to ``model``'s blocks for training, in
    place (:func:`autobatch.probing.apply_activation_checkpointing`, with the
    ``checkpoint_block_class`` option the probe used): each chosen block's ``forward`` becomes
    its non-reentrant checkpointed forward, an instance attribute on the block itself (no
    module replaced, no state renamed). Nothing changes when the plan's mode is ``"none"``.
    The returned undo, or :func:`autobatch.probing.remove_activation_checkpointing`, undoes it.

    Raises:
        ConfigError: as :func:`autobatch.probing.apply_activation_checkpointing`.
    """
    if plan.activation_checkpointing == "none":
        return lambda: None
    return apply_activation_checkpointing(
        model, plan.activation_checkpointing, block_class=options.get("checkpoint_block_class")
    )


def code_identity(function: Callable[..., Any]) -> str:
    """Qualified name and a SHA-256 of the code of ``function`` (unwrapping bound methods; nested
    code such as comprehensions by its own digest, see
    :func:`autobatch.probing._identity.callable_identity`): the same text for the same code in any
    process."""
    return callable_identity(getattr(function, "__func__", function))


class FrameworkStep:
    """A ``train_step(model, batch) -> loss`` that runs a framework's own step.

    The profile store keys a callable object by its class's code and its plain attributes (see
    :func:`autobatch.probing._identity.callable_identity`), ``identity`` among them (the user's step
    code,
    see :func:`code_identity`), so a profile is reused only while the user's step code is
    unchanged.

    Args:
        run: ``(model, batch) -> loss`` (a scalar tensor).
        identity: text that changes whenever the step's code does.
    """

    def __init__(self, run: Callable[[torch.nn.Module, Any], Any], *, identity: str) -> None:
        self._run = run
        self._identity = identity

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        return self._run(model, batch)

    def __repr__(self) -> str:
        return f"FrameworkStep({self._identity})"


def autotune_arguments(
    *,
    optimizer: torch.optim.Optimizer | None,
    device: str | Device | None,
    amp_dtype: torch.dtype | None,
    options: Mapping[str, Any],
    train_step: FrameworkStep | None = None,
    step_includes_update: bool = False,
) -> dict[str, Any]:
    """The keyword arguments a drop-in passes to :func:`autobatch.autotune`: what it read from
    the framework, then the user's ``options`` (already checked by :func:`check_options`; they
    override ``amp_dtype`` and hold the user's ``loss_fn``/``train_step`` where the drop-in has
    no step of its own), then the framework's own ``train_step`` when it has one."""
    arguments: dict[str, Any] = {
        "optimizer": optimizer,
        "device": device,
        "amp_dtype": amp_dtype,
        **options,
    }
    if train_step is not None:
        arguments.update(train_step=train_step, step_includes_update=step_includes_update)
    return arguments


def tune(
    model: torch.nn.Module,
    sample: Any,
    *,
    effective_batch_size: int | None,
    world_size: int,
    arguments: Mapping[str, Any],
    caller: str,
    constraint_note: str = "",
) -> Plan:
    """:func:`autobatch.autotune` with equal micro-batches and an exact effective batch (without
    ``effective_batch_size``: the largest micro-batch, one per optimizer step): the
    :class:`~autobatch.tuning.TuneRequest` of the framework's and the user's options, down the
    one road (:func:`~autobatch.tuning.tune_request`).

    ``arguments`` are the rest of the request's fields (:func:`autotune_arguments`). When no plan is
    exact, the error says so in the ``caller``'s terms, with ``constraint_note`` (why the
    framework adds a constraint) appended, and offers only remedies the caller accepts (not
    ``allow_inexact``).

    Raises:
        ConfigError, DoesNotFitError, StepFailedError, DeviceUnavailableError,
            NoFeasiblePlanError, StoreError, DistributedError: see :func:`autobatch.autotune`.
    """
    # A framework takes one micro-batch size, and the effective batch asked for, exactly.
    fixed: dict[str, Any] = {"world_size": world_size, "uneven": "never", "allow_inexact": False}
    try:
        if effective_batch_size is None:  # the largest micro-batch, one per optimizer step
            return tune_largest(largest_request(model, sample, {**arguments, **fixed})).plan
        request = TuneRequest.build(
            model,
            sample,
            effective_batch_size=effective_batch_size,
            **fixed,
            **arguments,
        )
        result = tune_request(request).plan
    except (ConfigError, NoFeasiblePlanError) as exc:
        if type(exc) not in (ConfigError, NoFeasiblePlanError) or not (
            isinstance(exc, NoFeasiblePlanError)
            or any(remedy.parameter in _NEVER_OFFERED for remedy in exc.remedies)
        ):
            raise
        # The planner offers ways (allow_inexact, unequal sizes) this caller never takes.
        raise type(exc)(
            f"{exc.message}; {caller} keeps the effective batch exact and gives the framework "
            f"one micro-batch size{constraint_note}",
            remedies=[r for r in exc.remedies if r.parameter not in _NEVER_OFFERED],
        ) from exc
    assert result.exact and not result.uneven, result
    return result


def with_epoch(plan: Plan, data: Any, *, drop_last: bool, caller: str, last_step: str) -> Plan:
    """``plan`` with its epoch (:meth:`Plan.with_epoch`; unchanged when ``data`` is None: a
    dataset without a length), and a WARNING on ``autobatch.integrations`` when an epoch's last
    optimizer step falls short of the effective batch (the frameworks step at an epoch's end
    with the micro-batches left), saying what the framework does with it (``last_step``)."""
    if data is None:
        return plan
    result = plan.with_epoch(data, drop_last=drop_last)
    epoch = result.epoch
    assert epoch is not None
    if not epoch.fills_every_step:
        logger.warning(
            "%s: %s; %s. For an exact effective batch at every step, give each epoch a "
            "multiple of %d rows (or drop_last=True)",
            caller,
            epoch.describe(plan.effective_batch_size),
            last_step,
            plan.effective_batch_size,
        )
    return result


def dataset_rows(dataset: object) -> int | None:
    """``len(dataset)`` for a map-style dataset; None for an iterable one or one without len."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def refuse_deepspeed(managed: bool, *, caller: str, where: str) -> None:
    """Refuse a run whose micro-batch DeepSpeed's own config sets: under DeepSpeed the engine
    takes ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` and
    ``train_batch_size`` from its config, not from the dataloader or the framework, so a plan
    applied to the loader would not be the batch that trains.

    Args:
        managed: whether DeepSpeed runs the step (the framework's own reading).
        caller: the drop-in, for the message.
        where: how the run turned DeepSpeed on, e.g. ``"Accelerator(deepspeed_plugin=...)"``.

    Raises:
        ConfigError: ``managed``, naming DeepSpeed's keys and the fix.
    """
    if managed:
        raise ConfigError(
            f"{caller} plans the dataloader's micro-batch, but under DeepSpeed ({where}) the "
            "engine's config sets it (train_micro_batch_size_per_gpu, "
            "gradient_accumulation_steps, train_batch_size): plan with autobatch.autotune "
            "and write the plan into DeepSpeed's config with "
            "autobatch.integrations.deepspeed_config(plan)"
        )
