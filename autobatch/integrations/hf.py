"""Hugging Face Trainer: :func:`autotune_trainer`, one call before ``trainer.train()``.

It probes the Trainer's model with the Trainer's own loss (``compute_loss``), the optimizer the
Trainer will create (or the one it was given), its precision (``bf16``/``fp16``) and activation
checkpointing settings, on a batch its data collator builds from the longest rows of its train
dataset, then sets ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` so that
``micro_batch_size * gradient_accumulation_steps * world_size == effective_batch_size``, where
``world_size`` is the Trainer's data-parallel size (``args.world_size`` over tensor, context and
sequence parallel sizes, times ``n_gpu`` under DataParallel). Under torch.distributed (torchrun)
every rank probes its own device and the ranks agree.

There is no ``TrainerCallback`` form: a callback's first hook in training (``on_train_begin``)
runs after the Trainer has built its train dataloader at the batch size in its arguments.

Example::

    from autobatch.integrations.hf import autotune_trainer

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
    plan = autotune_trainer(trainer, effective_batch_size=256)
    trainer.train()
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autobatch.device import Device
from autobatch.errors import ConfigError
from autobatch.extras import require
from autobatch.integrations._configs import hf_training_arguments
from autobatch.integrations._dropins import (
    SET_BY_FRAMEWORK,
    STEP_ARGUMENTS,
    FrameworkStep,
    autotune_arguments,
    check_checkpointing_asked,
    check_options,
    checkpoint_for_training,
    code_identity,
    dataset_rows,
    tune,
    with_epoch,
)
from autobatch.planning import Plan
from autobatch.probing import check_plan_here, preserved_rng, worst_case_sample

__all__ = ["autotune_trainer", "row_length"]

SAMPLE_ROWS = 4
"""Rows of the probe's sample: the longest ones of the train dataset by :func:`row_length`
(micro-batches of any size repeat them; see :func:`autobatch.worst_case_sample`)."""


def autotune_trainer(
    trainer: Any,
    effective_batch_size: int,
    *,
    device: str | Device | None = None,
    sample: Any = None,
    **options: Any,
) -> Plan:
    """Probe ``trainer``'s training step, then set its micro-batch and accumulation steps.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass), before ``train()``.
        effective_batch_size: samples per optimizer step over all ranks (> 0, a multiple of the
            data-parallel world size).
        device: the device to probe: None (the model's), ``"cuda:N"``, ``"sim:SIZE"`` (a
            simulated card for a CPU Trainer) or a Device.
        sample: a collated batch (a dict of tensors, batch dimension first) or a callable
            ``n -> batch`` (e.g. :func:`autobatch.worst_case_sample`) to probe instead of the
            train dataset's longest rows; for datasets too large to scan (every row is read once
            to find the longest) or a load measure other than :func:`row_length`.
        **options: probe and planner options of :func:`autobatch.autotune` (``safety_margin``,
            ``max_micro_batch_size``, ``multiple_of``, ``max_gradient_accumulation_steps``,
            ``store``, ``refresh``, ``amp_dtype``...); ``activation_checkpointing="auto"`` (or
            ``"selective"``, ``"full"``) chooses the mode with the micro-batch by real trials.

    A plan whose ``activation_checkpointing`` is not ``"none"`` turns the Trainer's own switch
    on for ``train()``: ``args.activation_checkpointing = True`` and
    ``args.activation_checkpointing_kwargs = {"every_n_layers": n, "use_reentrant": False}``
    (transformers 5; n is 1 for ``"full"``, 2 for ``"selective"``, the layers the probe
    checkpointed), or transformers 4's ``gradient_checkpointing`` for ``"full"`` (its
    ``"selective"``, which transformers 4 cannot express, wraps the blocks in place with
    :func:`autobatch.probing.apply_activation_checkpointing`); set the arguments back to undo
    it. Under ``"none"`` the arguments and the model are left as they were. Asking a mode of a
    Trainer whose arguments turn checkpointing on already is refused (the probe measures the
    Trainer's setting then).

    A WARNING on the ``autobatch.integrations`` logger says when the train dataset's rows do
    not fill whole optimizer steps (the Trainer's last step of an epoch then sees fewer samples,
    weighted as their mean). A callback added to the Trainer compares the plan's conditions with
    the process's when ``train()`` begins (its optimizer created, activation checkpointing on):
    each condition that moves memory and differs is a
    :class:`~autobatch.errors.ConditionsWarning` naming it.

    Under ``accelerator_config={"split_batches": True}`` the Trainer's dataloader batch is
    the batch of all ranks, which Accelerate splits among them: ``per_device_train_batch_size``
    (and the eval one) is then set to the micro-batch times the world size, so each rank still
    trains ``plan.micro_batch_size`` rows per micro-step.

    Returns:
        The Plan applied to ``trainer.args``, with its ``epoch`` (the train dataset's rows per
        epoch: micro-batches and optimizer steps per rank, the last step's effective batch):
        ``per_device_train_batch_size == plan.micro_batch_size`` (times the world size under
        ``split_batches``),
        ``gradient_accumulation_steps == plan.gradient_accumulation_steps``; with the option
        ``eval=True`` (the evaluation forward probed on its own, under
        ``torch.inference_mode``) also
        ``per_device_eval_batch_size == plan.eval_micro_batch_size``.

    Raises:
        ConfigError: an option autotune does not take or that this function sets itself; no
            train dataset; ``auto_find_batch_size`` on (it would halve the micro-batch without
            raising the accumulation steps, changing the effective batch); a checkpointing
            mode asked where the arguments or the model checkpoint already; DeepSpeed or FSDP
            (their memory is sharded: call autobatch.autotune on the sharded step).
        DoesNotFitError, NoFeasiblePlanError, StepFailedError, DistributedError: see
            :func:`autobatch.autotune`.
    """
    check_options(options, caller="autotune_trainer", owned=SET_BY_FRAMEWORK | STEP_ARGUMENTS)
    _check_trainer(trainer, options)
    args, model = trainer.args, trainer.model
    world_size = _trainer_world_size(trainer)
    model_device = next(model.parameters()).device
    sample = (
        _worst_case_sample(trainer, model_device) if sample is None else _to(sample, model_device)
    )
    step = FrameworkStep(
        lambda model, batch: _compute_loss(trainer, model, batch),
        identity=f"{code_identity(type(trainer).compute_loss)}:"
        f"smoothing={getattr(trainer, 'label_smoother', None)!r}:"
        f"loss_func={code_identity(getattr(trainer, 'compute_loss_func', None) or _compute_loss)}",
        # Activation checkpointing needs no mention: it is a recorded condition of the profile
        # (each module's gradient_checkpointing flag and checkpoint function), on during the
        # probe below as train() will turn it on.
    )
    amp_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    with _trainer_optimizer(trainer) as optimizer, _checkpointing(model, args):
        result = tune(
            model,
            sample,
            effective_batch_size=effective_batch_size,
            world_size=world_size,
            arguments=autotune_arguments(
                optimizer=optimizer,
                device=device,
                amp_dtype=amp_dtype,
                options=options,
                train_step=step,
            ),
            caller="autotune_trainer",
        )
    split = _split_over(args, world_size)
    args.per_device_train_batch_size = result.micro_batch_size * split
    args.gradient_accumulation_steps = result.gradient_accumulation_steps
    if result.eval_micro_batch_size is not None:
        args.per_device_eval_batch_size = result.eval_micro_batch_size * split
    trainer._train_batch_size = args.train_batch_size  # what train() builds its dataloader with
    total = trainer.get_total_train_batch_size(args)
    # Under split_batches the Trainer counts the loader's batch (already over the ranks) once
    # per rank, so its total is the effective batch times the ranks.
    if total != effective_batch_size * split:
        raise ConfigError(
            f"the Trainer now computes a total train batch of {total}, not the effective batch "
            f"{effective_batch_size} planned ({result.micro_batch_size} x "
            f"{result.gradient_accumulation_steps} x world size {world_size}); its parallel "
            "layout is one autotune_trainer does not know: plan with autobatch.autotune"
        )
    switched = _switch_on_checkpointing(trainer, result, options)
    _check_when_training_starts(trainer, result, amp_dtype, switched=switched)
    return with_epoch(
        result,
        dataset_rows(trainer.train_dataset),
        drop_last=bool(args.dataloader_drop_last),
        caller="autotune_trainer",
        last_step=(
            "the Trainer divides that step's losses by its own number of micro-batches (or by "
            "the items counted, num_items_in_batch, for a model that takes it), so the step is "
            "the mean of its samples (a short last micro-batch counts as a whole one where "
            "items are not counted)"
        ),
    )


def _check_trainer(trainer: Any, options: Mapping[str, Any]) -> None:
    """Refuse a Trainer whose batch or memory the plan cannot speak for (see
    :func:`autotune_trainer`'s Raises)."""
    args = trainer.args
    if args.auto_find_batch_size:
        raise ConfigError(
            "TrainingArguments(auto_find_batch_size=True) halves the micro-batch on an OOM "
            "without raising gradient_accumulation_steps, so the effective batch would shrink; "
            "set auto_find_batch_size=False when autotune_trainer plans the batch"
        )
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(
        trainer, "is_fsdp_enabled", False
    ):
        raise ConfigError(
            "autotune_trainer probes an unsharded model; under DeepSpeed or FSDP call "
            "autobatch.autotune on the sharded model and step, then set "
            "per_device_train_batch_size and gradient_accumulation_steps from the plan"
        )
    switch = "TrainingArguments(activation_checkpointing=True)"
    already = switch if _checkpointing_wanted(args) else ""
    check_checkpointing_asked(trainer.model, options, caller="autotune_trainer", already=already)


def _switch_on_checkpointing(trainer: Any, plan: Plan, options: Mapping[str, Any]) -> bool:
    """Turn on, for ``train()``, the activation checkpointing ``plan`` chose (nothing for
    ``"none"``): the Trainer's own switch, ``activation_checkpointing=True`` with
    ``activation_checkpointing_kwargs={"every_n_layers": n, "use_reentrant": False}``
    (transformers 5: the layers the probe checkpointed, n 1 for ``"full"``, 2 for
    ``"selective"``), or transformers 4's ``gradient_checkpointing=True`` for ``"full"``;
    transformers 4 has no ``every_n_layers``, so ``"selective"`` there is autobatch's own
    wrapping of the blocks, in place (:func:`autobatch.probing.remove_activation_checkpointing`
    undoes it). True when the Trainer's switch was set."""
    if plan.activation_checkpointing == "none":
        return False
    args = trainer.args
    wanted = hf_training_arguments(plan)
    if hasattr(args, "activation_checkpointing"):  # transformers >= 5
        args.activation_checkpointing = True
        args.activation_checkpointing_kwargs = wanted["activation_checkpointing_kwargs"]
        return True
    if plan.activation_checkpointing == "full":
        args.gradient_checkpointing = True
        args.gradient_checkpointing_kwargs = {"use_reentrant": False}
        return True
    checkpoint_for_training(trainer.model, plan, options)
    return False


def _check_when_training_starts(
    trainer: Any, plan: Plan, amp_dtype: torch.dtype | None, *, switched: bool
) -> None:
    """Add a callback that compares ``plan``'s conditions with the process's when ``train()``
    begins (its optimizer created, activation checkpointing turned on): one per Trainer.

    When the drop-in set the Trainer's checkpointing switch (``switched``) for the blocks the
    probe checkpointed with autobatch's wrapping, the two describe the same recompute in other
    words: while the Trainer's flags are on, that condition is not compared (turned off, the
    difference is warned of as any other)."""
    require("transformers", extra="hf", purpose="autotune_trainer")
    from transformers import TrainerCallback

    class PlanConditionsCheck(TrainerCallback):
        """autobatch: the plan's conditions checked when training begins."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer = kwargs.get("optimizer")
            model = kwargs.get("model") or trainer.model
            checked = plan
            if switched and _checkpointing_active(model):
                checked = dataclasses.replace(
                    plan,
                    conditions=dataclasses.replace(plan.conditions, activation_checkpointing=""),
                )
            check_plan_here(
                checked,
                model,
                getattr(optimizer, "optimizer", optimizer),  # Accelerate's wrapper holds one
                where="autotune_trainer",
                amp_dtype=amp_dtype,
            )

    handler = trainer.callback_handler
    for callback in list(handler.callbacks):
        if type(callback).__name__ == PlanConditionsCheck.__name__:
            handler.remove_callback(callback)
    trainer.add_callback(PlanConditionsCheck())


def _split_over(args: Any, world_size: int) -> int:
    """How many ranks one dataloader batch is split over: ``world_size`` under Accelerate's
    ``split_batches`` (``TrainingArguments(accelerator_config={"split_batches": True})``: the
    loader's batch is the batch of all ranks, each taking its slice), else 1 (each rank's
    loader batch is its micro-batch; ``dispatch_batches`` alone keeps that)."""
    config = getattr(args, "accelerator_config", None)
    split = config.get("split_batches") if isinstance(config, Mapping) else None
    if split is None:
        split = getattr(config, "split_batches", False)
    return world_size if split else 1


def _trainer_world_size(trainer: Any) -> int:
    """Ranks that each take a different micro-batch: the world size over the tensor, context
    and sequence parallel sizes, times the GPUs one process drives under DataParallel."""
    args = trainer.args
    size = int(args.world_size)
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        get = getattr(trainer, name, None)
        if callable(get):
            size //= int(get())
    return size * max(1, int(args.n_gpu))


def _compute_loss(trainer: Any, model: torch.nn.Module, batch: Mapping[str, Any]) -> Any:
    """The Trainer's loss for one micro-batch, under its autocast context."""
    with trainer.compute_loss_context_manager():
        return trainer.compute_loss(model, dict(batch))  # it may pop "labels"


@contextlib.contextmanager
def _trainer_optimizer(trainer: Any) -> Iterator[torch.optim.Optimizer]:
    """The optimizer the Trainer trains with: the one it was given, or the one
    ``create_optimizer`` builds (discarded afterwards, so ``train()`` builds its own)."""
    if trainer.optimizer is not None:
        yield trainer.optimizer
        return
    try:
        yield trainer.create_optimizer()
    finally:
        trainer.optimizer = None


def _checkpointing_wanted(args: Any) -> bool:
    """The Trainer will turn activation checkpointing on in ``train()``."""
    return bool(
        getattr(args, "activation_checkpointing", False)
        or getattr(args, "gradient_checkpointing", False)
    )


def _checkpointing_active(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@contextlib.contextmanager
def _checkpointing(model: torch.nn.Module, args: Any) -> Iterator[None]:
    """Activation checkpointing on during the probe when the Trainer will turn it on in
    ``train()``, with the same settings; off again afterwards."""
    if not _checkpointing_wanted(args) or _checkpointing_active(model):
        yield
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):  # transformers >= 5
        kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
        every_n_layers = kwargs.pop("every_n_layers", 1)
        offload = kwargs.pop("offload", False)
        enable(
            activation_checkpointing_kwargs=kwargs or None,
            every_n_layers=every_n_layers,
            offload=offload,
        )
        disable = model.activation_checkpointing_disable
    elif callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs=getattr(args, "gradient_checkpointing_kwargs", None)
        )
        disable = model.gradient_checkpointing_disable
    else:
        raise ConfigError(
            f"the Trainer will turn on activation checkpointing, but {type(model).__name__} has "
            "no activation_checkpointing_enable(); turn it on in the model before autotune_trainer"
        )
    try:
        yield
    finally:
        disable()  # type: ignore[operator]


def _worst_case_sample(trainer: Any, device: torch.device) -> Any:
    """The Trainer's data collator over the longest rows of its train dataset (with the columns
    its dataloader drops already dropped), on ``device``: a
    :class:`~autobatch.probing._worst_case.WorstCaseSample` (the profile notes the length probed),
    or the collated first rows of an iterable dataset."""
    if trainer.train_dataset is None:
        raise ConfigError("the Trainer has no train_dataset; pass train_dataset=... or sample=...")
    with preserved_rng():
        loader = trainer.get_train_dataloader()  # the dataset and collator train() will use
    dataset, collate = loader.dataset, loader.collate_fn
    registered = getattr(trainer.accelerator, "_dataloaders", None)
    if isinstance(registered, list) and loader in registered:
        registered.remove(loader)  # only built to read the two above
    del loader

    def collate_on_device(rows: list[Any]) -> Any:
        return _to(collate(rows), device)

    with preserved_rng():  # reading rows may draw random numbers (augmentation)
        if dataset_rows(dataset) is not None:
            return worst_case_sample(
                dataset, key=row_length, collate_fn=collate_on_device, num_items=SAMPLE_ROWS
            )
        rows: list[Any] = []  # no length to scan: the first rows
        for row in dataset:
            rows.append(row)
            if len(rows) == SAMPLE_ROWS:
                break
    if not rows:
        raise ConfigError("the Trainer's train_dataset is empty; give it rows to train on")
    return collate_on_device(rows)


def _to(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def row_length(row: Any) -> int:
    """A row's load: the length of its longest sequence field (a list, a tuple or a tensor's
    first dimension; a mapping's values or a tuple's items), 0 when it has none.

    Example::

        row_length({"input_ids": [5, 7, 9], "label": 1})   # 3
    """
    values = row.values() if isinstance(row, Mapping) else row if isinstance(row, tuple) else [row]
    longest = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            longest = max(longest, int(value.shape[0]) if value.dim() > 0 else 0)
        elif isinstance(value, list | tuple):
            longest = max(longest, len(value))
    return longest
