"""Hugging Face Accelerate: :func:`autotune_accelerator` plans the batch for a model and dataloader
prepared by an ``Accelerator`` and sets the Accelerator's gradient accumulation steps.

It probes the unwrapped model (no DDP wrapper, so no collective inside a trial) with a batch drawn
from the dataloader, the optimizer (unwrapped from Accelerate's), and the Accelerator's mixed
precision, on its device; every process probes its own device and the processes agree. The
dataloader keeps its batch size: build it again with ``batch_size=plan.micro_batch_size`` and
prepare it, so that ``micro_batch_size * gradient_accumulation_steps * num_processes ==
effective_batch_size``.

Example::

    from autobatch.integrations.accelerate import autotune_accelerator

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan = autotune_accelerator(accelerator, model, loader, 256, optimizer=optimizer,
                                loss_fn=torch.nn.functional.cross_entropy)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=plan.micro_batch_size))
    for batch in loader:
        with accelerator.accumulate(model):   # steps every plan.gradient_accumulation_steps
            ...
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from autobatch.device import Device
from autobatch.errors import ConfigError
from autobatch.integrations._dropins import (
    SET_BY_FRAMEWORK,
    autotune_arguments,
    check_checkpointing_asked,
    check_options,
    checkpoint_for_training,
    dataset_rows,
    refuse_deepspeed,
    tune,
    with_epoch,
)
from autobatch.planning import Plan
from autobatch.probing import preserved_rng

__all__ = ["autotune_accelerator"]

_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autotune_accelerator(
    accelerator: Any,
    model: torch.nn.Module,
    dataloader: Any,
    effective_batch_size: int,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | Device | None = None,
    **options: Any,
) -> Plan:
    """Probe the step, plan it, and set ``accelerator.gradient_accumulation_steps``.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        model: the model, prepared by ``accelerator`` (or not).
        dataloader: a DataLoader (prepared or not); its first batch is the probe's sample, so a
            batch of the longest inputs makes the plan safe for all of them.
        effective_batch_size: samples per optimizer step over all processes (> 0, a multiple of
            ``accelerator.num_processes``).
        optimizer: the training optimizer (Accelerate's wrapper or the torch one); None probes
            with an AdamW.
        device: None (the model's device), ``"cuda:N"``, ``"sim:SIZE"`` or a Device.
        **options: how a batch becomes a loss (``loss_fn``, ``train_step``,
            ``step_includes_update``; see :func:`autobatch.autotune`) and its probe and planner
            options (``safety_margin``, ``max_gradient_accumulation_steps``, ``store``...);
            ``activation_checkpointing="auto"`` (or ``"selective"``, ``"full"``) chooses the
            mode with the micro-batch by real trials, and a mode other than ``"none"`` chosen
            is applied to the model's blocks for training (below).

    A plan whose ``activation_checkpointing`` is not ``"none"`` leaves the model's blocks
    checkpointed in place, as the probe measured them
    (:func:`autobatch.probing.apply_activation_checkpointing`: each block's ``forward`` an
    instance attribute running non-reentrant ``torch.utils.checkpoint``; Accelerate has no
    switch of its own); ``autobatch.probing.remove_activation_checkpointing(model)`` undoes it.
    Under ``"none"`` the model is left as it was.

    Returns:
        The Plan, with its ``epoch`` (the dataloader's dataset rows per epoch: micro-batches and
        optimizer steps per rank, the last step's effective batch);
        ``accelerator.gradient_accumulation_steps`` is its ``gradient_accumulation_steps``.
        Rebuild the dataloader with ``plan.micro_batch_size``. When the rows do not fill whole
        optimizer steps, a WARNING on ``autobatch.integrations`` says so: Accelerate divides
        every loss by the accumulation steps, so an epoch's short last step applies only that
        share of its gradient.

    Raises:
        ConfigError: an option autotune does not take or that this function sets itself; an
            empty dataloader; a checkpointing mode asked of a model that checkpoints already;
            ``split_batches=True`` with more than one process (the loader's batch would be
            split over them); DeepSpeed running the step (its config sets the micro-batch).
        DoesNotFitError, NoFeasiblePlanError, StepFailedError, DistributedError: see
            :func:`autobatch.autotune`.
    """
    check_options(options, caller="autotune_accelerator", owned=SET_BY_FRAMEWORK)
    _refuse_split_batches(accelerator)
    refuse_deepspeed(
        getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is not None,
        caller="autotune_accelerator",
        where="Accelerator(deepspeed_plugin=...) or accelerate config",
    )
    unwrapped = accelerator.unwrap_model(model)
    check_checkpointing_asked(unwrapped, options, caller="autotune_accelerator")
    inner_optimizer = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps one
    sample = _first_batch(dataloader, next(unwrapped.parameters()).device)
    result = tune(
        unwrapped,
        sample,
        effective_batch_size=effective_batch_size,
        world_size=int(accelerator.num_processes),
        arguments=autotune_arguments(
            optimizer=inner_optimizer,
            device=device,
            amp_dtype=_AMP_DTYPES.get(str(accelerator.mixed_precision)),
            options=options,
        ),
        caller="autotune_accelerator",
    )
    accelerator.gradient_accumulation_steps = result.gradient_accumulation_steps
    checkpoint_for_training(unwrapped, result, options)  # Accelerate has no switch of its own
    base = getattr(dataloader, "base_dataloader", dataloader)
    steps = result.gradient_accumulation_steps
    return with_epoch(
        result,
        dataset_rows(getattr(base, "dataset", None)),
        drop_last=bool(getattr(base, "drop_last", False)),
        caller="autotune_accelerator",
        last_step=(
            f"accelerator.backward() divides every micro-batch's loss by {steps} "
            "(gradient_accumulation_steps), also in that step, so it applies only its share of "
            f"{steps} micro-batches: with j of them, j/{steps} of their mean gradient (multiply "
            f"their losses by {steps}/j to make it their mean)"
        ),
    )


def _refuse_split_batches(accelerator: Any) -> None:
    """Refuse Accelerate's ``split_batches`` over several processes: the dataloader's batch is
    then the batch of all processes, each taking its slice, so a loader rebuilt with
    ``plan.micro_batch_size`` would train ``1 / num_processes`` of the effective batch.
    (``dispatch_batches`` alone keeps each process's batch the loader's: nothing to refuse.)

    Raises:
        ConfigError: ``split_batches=True`` with more than one process (names it and the fix).
    """
    processes = int(accelerator.num_processes)
    if processes > 1 and bool(getattr(accelerator, "split_batches", False)):
        raise ConfigError(
            "Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True)) splits "
            f"each dataloader batch over the {processes} processes, so a dataloader of "
            f"batch_size=plan.micro_batch_size would train 1/{processes} of the effective "
            "batch; autotune_accelerator plans per-process micro-batches: use "
            "split_batches=False (the default), or keep it and build the dataloader with "
            f"batch_size=plan.micro_batch_size * {processes} after planning with "
            "autobatch.autotune(..., world_size=accelerator.num_processes)"
        )


def _first_batch(dataloader: Any, device: torch.device) -> Any:
    """The first batch of the dataloader's underlying DataLoader (Accelerate's wrapper keeps
    iteration state and synchronises RNGs across processes; the plain one does neither), on
    ``device``, with the RNG streams left as they were."""
    base = getattr(dataloader, "base_dataloader", dataloader)
    with preserved_rng():
        iterator = iter(base)
        try:
            batch = next(iterator)
        except StopIteration:
            raise ConfigError(
                "the dataloader gave no batch; autotune_accelerator probes with its first one"
            ) from None
        finally:
            del iterator
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
