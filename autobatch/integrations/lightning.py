"""PyTorch Lightning: :class:`AutobatchFinder`, a drop-in for ``BatchSizeFinder`` that keeps the
effective batch exact.

At fit start it probes the LightningModule's own ``training_step`` (with the optimizer from
``configure_optimizers``, the Trainer's precision, on the Trainer's device, with a batch drawn from
the module's or datamodule's train dataloader), then sets the batch size attribute (the names
``BatchSizeFinder`` looks for: the module, its ``hparams``, the datamodule, its ``hparams``) and
``Trainer.accumulate_grad_batches`` so that
``micro_batch_size * accumulate_grad_batches * world_size == effective_batch_size``, and the train
dataloader is rebuilt. Under DDP every rank probes its own device and the ranks agree (a size fits
only if it fits on every rank); ``BatchSizeFinder`` refuses distributed strategies.

Example::

    from autobatch.integrations.lightning import AutobatchFinder

    trainer = lightning.pytorch.Trainer(callbacks=[AutobatchFinder(effective_batch_size=256)])
    trainer.fit(module)          # module.batch_size and trainer.accumulate_grad_batches are set
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autobatch.device import Device
from autobatch.errors import ConfigError
from autobatch.extras import needs_extra
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
    refuse_deepspeed,
    tune,
    with_epoch,
)
from autobatch.planning import Plan
from autobatch.probing import check_plan_here, preserved_rng

with needs_extra("lightning", purpose="autobatch.integrations.lightning"):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
    from torchmetrics import Metric

__all__ = ["AutobatchFinder"]

logger = logging.getLogger("autobatch.integrations")

_AMP_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
"""Lightning precision settings that autocast the step (the probe autocasts the same way)."""


class AutobatchFinder(Callback):
    """Set the micro-batch and ``accumulate_grad_batches`` that reach ``effective_batch_size``;
    without it, the largest micro-batch (``BatchSizeFinder``'s question, answered by the probe).

    Args:
        effective_batch_size: samples per optimizer step over all ranks (> 0, a multiple of the
            Trainer's world size); None (the default): the largest micro-batch that keeps the
            safety margin, with ``accumulate_grad_batches`` 1.
        device: the device to probe: None (the Trainer's device), ``"cuda:N"`` or
            ``"sim:SIZE"`` (a simulated card on the CPU Trainer), or a Device.
        batch_arg_name: the attribute the train dataloader reads its batch size from (as
            ``BatchSizeFinder``'s).
        **options: probe and planner options of :func:`autobatch.autotune` (``safety_margin``,
            ``max_micro_batch_size``, ``multiple_of``, ``max_gradient_accumulation_steps``,
            ``store``, ``refresh``...); ``activation_checkpointing="auto"`` (or
            ``"selective"``, ``"full"``) chooses the mode with the micro-batch by real trials.

    Attributes:
        plan: the Plan applied at the last fit start (None before).
        undo_checkpointing: undoes the activation checkpointing the finder applied for
            training (a no-op when the plan's mode is ``"none"``); the next fit start calls it
            before probing again.

    A plan whose ``activation_checkpointing`` is not ``"none"`` leaves the module's blocks
    checkpointed in place for training, as the probe measured them
    (:func:`autobatch.probing.apply_activation_checkpointing`: each block's ``forward`` an
    instance attribute running non-reentrant ``torch.utils.checkpoint``; Lightning's Trainer
    has no switch for it outside ``FSDPStrategy``): ``finder.undo_checkpointing()`` or
    ``autobatch.probing.remove_activation_checkpointing(module)`` puts the blocks back. Under
    ``"none"`` the module is left as it was.

    Raises:
        ConfigError: at construction, an option autotune does not take or that the finder sets
            itself (the model, step, optimizer, world size), or ``eval=True`` (Lightning sizes
            evaluation through your ``val_dataloader``). At fit start: the batch size
            attribute is missing, the dataloader was passed to ``fit()`` directly or ignores the
            attribute, several optimizers or train dataloaders, a ``GradientAccumulationScheduler``,
            manual optimization that would need accumulation, ``SyncBatchNorm`` across ranks,
            a checkpointing mode asked of a module that checkpoints already.
        DoesNotFitError, NoFeasiblePlanError, StepFailedError, DistributedError: see
            :func:`autobatch.autotune`.

    When training starts (``on_train_start``) the plan's conditions are compared with the
    process's again (:func:`autobatch.probing._live_conditions.check_plan_here`): a condition that
    moves memory and changed since fit start (cuDNN flags, the allocator, the module's dtypes,
    sharding or checkpointing) is a :class:`~autobatch.errors.ConditionsWarning` naming it.

    Lightning steps at an epoch's end with the micro-batches left, so that step sees fewer
    samples when the train dataset's rows do not fill whole optimizer steps; a WARNING on the
    ``autobatch.integrations`` logger says so (give the dataset a multiple of
    ``effective_batch_size`` rows), and the finder weights that step's micro-batches by their
    samples (Lightning divides each loss by ``accumulate_grad_batches``, which would apply only
    that share of a short step's gradient), so the step is the exact mean of its samples. An
    epoch shorter than one optimizer step (``num_training_batches < accumulate_grad_batches``)
    never reaches ``effective_batch_size``: it is refused (a WARNING when
    ``limit_train_batches`` shortened it). ``plan.epoch`` has the numbers per epoch.
    """

    def __init__(
        self,
        effective_batch_size: int | None = None,
        *,
        device: str | Device | None = None,
        batch_arg_name: str = "batch_size",
        **options: Any,
    ) -> None:
        check_options(options, caller="AutobatchFinder", owned=SET_BY_FRAMEWORK | STEP_ARGUMENTS)
        if options.get("eval"):
            raise ConfigError(
                "AutobatchFinder got eval=True, but it probes the module's training_step only: "
                "Lightning takes the validation batch size from your val_dataloader, not from the "
                "Trainer; remove eval=True and size that loader with "
                "autobatch.probe(model, sample, eval=True).max_micro_batch_size"
            )
        if effective_batch_size is not None and (
            isinstance(effective_batch_size, bool) or not isinstance(effective_batch_size, int)
        ):
            raise ConfigError(
                f"effective_batch_size {effective_batch_size!r} must be an int (samples per "
                "optimizer step over all ranks)"
            )
        self.effective_batch_size = effective_batch_size
        self.device = device
        self.batch_arg_name = batch_arg_name
        self.options = dict(options)
        self.plan: Plan | None = None
        self.undo_checkpointing: Callable[[], None] = lambda: None
        self._weights: _LastStepWeights | None = None
        self._factor = 1.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.fit_loop._data_source.is_module():  # as BatchSizeFinder checks it
            raise ConfigError(
                "AutobatchFinder cannot resize a dataloader passed to trainer.fit() directly; "
                "return it from LightningModule.train_dataloader() or a LightningDataModule, "
                f"built with batch_size=self.{self.batch_arg_name}"
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"AutobatchFinder found no {self.batch_arg_name!r} in the model, the datamodule, "
                f"or their hparams; add self.{self.batch_arg_name} and build the train dataloader "
                f"with it, or pass batch_arg_name=... naming the attribute you use"
            )
        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):  # type: ignore[attr-defined]
            raise ConfigError(
                "AutobatchFinder sets accumulate_grad_batches, which a "
                "GradientAccumulationScheduler callback would change per epoch (and the "
                "effective batch with it); remove one of the two"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.undo_checkpointing()  # a previous fit's, before probing the module again
        self.undo_checkpointing = lambda: None
        self.plan = _tune(
            trainer,
            pl_module,
            effective_batch_size=self.effective_batch_size,
            device=self.device,
            batch_arg_name=self.batch_arg_name,
            options=self.options,
        )
        self.undo_checkpointing = checkpoint_for_training(pl_module, self.plan, self.options)
        self._weights = _LastStepWeights.of(self.plan, trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._factor = 1.0 if self._weights is None else self._weights.factor(batch_idx)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._factor != 1.0:  # the epoch's short last step: its micro-batch's share
            loss.mul_(self._factor)  # the tensor Lightning backpropagates next

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan is None:
            return
        check_plan_here(
            self.plan,
            pl_module,
            trainer.optimizers[0] if trainer.optimizers else None,
            where="AutobatchFinder",
            amp_dtype=_AMP_DTYPES.get(str(trainer.precision)),
            sourced_world_size=(trainer.world_size, "the Trainer's world_size"),
        )


def _tune(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    *,
    effective_batch_size: int | None,
    device: str | Device | None,
    batch_arg_name: str,
    options: dict[str, Any],
) -> Plan:
    """Probe, plan and apply (what :class:`AutobatchFinder` does at fit start); see there."""
    check_checkpointing_asked(pl_module, options, caller="AutobatchFinder")
    refuse_deepspeed(
        # By name: importing Lightning's DeepSpeedStrategy needs deepspeed installed.
        any(kind.__name__ == "DeepSpeedStrategy" for kind in type(trainer.strategy).__mro__),
        caller="AutobatchFinder",
        where="Trainer(strategy='deepspeed...')",
    )
    optimizers = trainer.optimizers
    if len(optimizers) != 1:
        raise ConfigError(
            f"AutobatchFinder probes a step with one optimizer; configure_optimizers gave "
            f"{len(optimizers)}. Use autobatch.autotune with your own train_step instead"
        )
    world_size = trainer.world_size
    if world_size > 1 and any(isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()):
        raise ConfigError(
            "SyncBatchNorm gathers statistics across ranks inside the forward pass, so ranks "
            "cannot agree on a failed trial before that collective; turn off sync_batchnorm for "
            "the tuning run, or tune with autobatch.autotune on one rank"
        )
    manual = not pl_module.automatic_optimization
    tuning_options = dict(options)
    if manual:  # Lightning does not accumulate for manual optimization: one micro-batch a step
        tuning_options["max_gradient_accumulation_steps"] = 1
    sample = _draw_batch(trainer)
    step = FrameworkStep(
        lambda model, batch: _training_step_loss(
            trainer, model, batch, manual=manual, estimating=model is not pl_module
        ),
        identity=code_identity(type(pl_module).training_step),
    )
    with _probing(trainer, pl_module):
        result = tune(
            pl_module,
            sample,
            effective_batch_size=effective_batch_size,
            world_size=world_size,
            arguments=autotune_arguments(
                optimizer=optimizers[0],
                device=device,
                amp_dtype=_AMP_DTYPES.get(str(trainer.precision)),
                options=tuning_options,
                train_step=step,
                step_includes_update=manual,
            ),
            caller="AutobatchFinder",
            constraint_note=(
                " (under manual optimization Lightning does not accumulate gradients, so one "
                "micro-batch must hold effective_batch_size / world_size samples)"
                if manual
                else ""
            ),
        )
    del sample
    lightning_setattr(pl_module, batch_arg_name, result.micro_batch_size)
    trainer.accumulate_grad_batches = result.gradient_accumulation_steps
    return _rebuild_train_dataloader(trainer, result, batch_arg_name)


class _LastStepWeights:
    """The factor on each micro-batch's loss of an epoch that makes Lightning's last optimizer
    step, when short, the mean of its samples: Lightning divides every loss by
    ``accumulate_grad_batches`` (k); a micro-batch of n samples in a last step of N needs
    ``n / N``, so the factor is ``k * n / N`` (1 for every micro-batch of a full step).

    Args:
        plan: the plan, with its epoch.
        num_batches: micro-batches Lightning runs per epoch (``num_training_batches``).
        loader_length: micro-batches the loader yields per epoch (the last may be partial).
    """

    def __init__(self, plan: Plan, num_batches: int, loader_length: int) -> None:
        epoch = plan.epoch
        assert epoch is not None
        size, steps = plan.micro_batch_size, plan.gradient_accumulation_steps
        last_size = (
            size if epoch.drop_last else epoch.num_rows_per_rank - (loader_length - 1) * size
        )
        self.start = (num_batches - 1) // steps * steps  # the first batch of the last step
        sizes = [
            last_size if index == loader_length - 1 else size
            for index in range(self.start, num_batches)
        ]
        self.factors = [steps * rows / sum(sizes) for rows in sizes]

    @classmethod
    def of(cls, plan: Plan, trainer: pl.Trainer) -> _LastStepWeights | None:
        """The weights of ``plan``'s epochs under ``trainer``; None when every step is whole
        or the epoch's length is unknown."""
        num_batches = trainer.num_training_batches
        loader = trainer.train_dataloader
        if plan.epoch is None or not isinstance(num_batches, int) or num_batches < 1:
            return None
        weights = cls(plan, num_batches, len(loader))  # type: ignore[arg-type]
        return None if all(factor == 1.0 for factor in weights.factors) else weights

    def factor(self, batch_index: int) -> float:
        if batch_index < self.start or batch_index - self.start >= len(self.factors):
            return 1.0
        return self.factors[batch_index - self.start]


def _single_train_loader(trainer: pl.Trainer) -> torch.utils.data.DataLoader[Any]:
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigError(
            f"AutobatchFinder needs one train DataLoader, got {type(loader).__name__}; tune "
            "with autobatch.autotune for several train dataloaders"
        )
    return loader


def _draw_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader, on the Trainer's device (through the module's
    batch transfer hooks); the RNG streams are left as they were."""
    with preserved_rng():  # building the loader draws from torch's RNG, as iterating it does
        trainer.fit_loop.setup_data()
        loader = _single_train_loader(trainer)
        iterator = iter(loader)
        try:
            batch = next(iterator)
        except StopIteration:
            raise ConfigError(
                "the train dataloader gave no batch; AutobatchFinder probes with one"
            ) from None
        finally:
            del iterator
    return trainer.strategy.batch_to_device(batch)


def _training_step_loss(
    trainer: pl.Trainer, module: torch.nn.Module, batch: Any, *, manual: bool, estimating: bool
) -> torch.Tensor:
    """``module.training_step`` as Lightning runs it (under the precision plugin's context),
    reduced to its loss tensor.

    ``module`` is the LightningModule, or (``estimating``) the estimator's copy of it on fake
    tensors, whose torchmetrics metrics are switched off: their updates cost next to no memory,
    and some (``bincount`` in accuracy) cannot run on fake tensors. The copy has no Trainer
    attached: a step that needs one is not estimated, and the probe searches by doubling.
    """
    if estimating:
        _switch_off_metrics(module)
    with trainer.precision_plugin.train_step_context():
        output = module.training_step(batch, 0)  # type: ignore[operator]
    if isinstance(output, dict):
        output = output.get("loss")
    if isinstance(output, torch.Tensor):
        return output
    if manual:  # the step already ran backward and stepped; its return value is free-form
        return torch.zeros((), device=next(module.parameters()).device)
    raise ConfigError(
        f"training_step returned {type(output).__name__} for the probe's batch; AutobatchFinder "
        "needs the loss (a tensor, or a dict with 'loss') to probe the whole step"
    )


def _switch_off_metrics(module: torch.nn.Module) -> None:
    """Every torchmetrics Metric in ``module`` ignores updates (its ``update`` and ``forward``
    return None). Only for the estimator's throwaway copy."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.update = ignore  # type: ignore[method-assign]
            metric.forward = ignore  # type: ignore[method-assign]


@contextlib.contextmanager
def _probing(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
    """While the probe runs ``training_step`` outside Lightning's loop: ``self.log`` and
    ``self.log_dict`` do nothing (no results collection is active at fit start), DDP's gradient
    synchronisation is off (no collective inside a trial), and the GradScaler's state and fresh
    torchmetrics metrics are restored afterwards."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    wrapped = trainer.strategy.model
    no_sync = getattr(wrapped, "no_sync", None)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scaler_state = scaler.state_dict() if scaler is not None else None
    fresh_metrics = [m for m in pl_module.modules() if isinstance(m, Metric) and not m.update_count]
    pl_module.log = ignore  # type: ignore[method-assign]
    pl_module.log_dict = ignore  # type: ignore[method-assign]
    try:
        with no_sync() if callable(no_sync) else contextlib.nullcontext():
            yield
    finally:
        del pl_module.log, pl_module.log_dict
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        for metric in fresh_metrics:
            metric.reset()


def _rebuild_train_dataloader(trainer: pl.Trainer, plan: Plan, name: str) -> Plan:
    """Rebuild the train dataloader (as Lightning's tuner does), check that it now gives
    micro-batches of ``plan.micro_batch_size`` and that an epoch holds one optimizer step at
    least; the plan with its epoch. The fit loop then uses the loader as built here, so this
    build takes the RNG draws Lightning's own build would have taken.

    Raises:
        ConfigError: the loader ignores the batch size attribute; the loader's epoch has fewer
            micro-batches than ``accumulate_grad_batches`` (no step would reach the effective
            batch).
    """
    loop = trainer.fit_loop
    loop._combined_loader = None  # force a reload, as lightning.pytorch.tuner does
    loop.setup_data()
    loader = _single_train_loader(trainer)
    batch_size = loader.batch_size
    if batch_size is None and loader.batch_sampler is not None:
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
    if batch_size != plan.micro_batch_size:
        raise ConfigError(
            f"after setting {name}={plan.micro_batch_size}, the rebuilt train dataloader has batch "
            f"size {batch_size}; build it with DataLoader(..., batch_size=self.{name}) so the "
            "effective batch is exact"
        )
    rows = dataset_rows(loader.dataset)
    result = with_epoch(
        plan,
        None if rows is None else loader,
        drop_last=loader.drop_last,
        caller="AutobatchFinder",
        last_step=(
            "AutobatchFinder weights that step's micro-batches by their samples (Lightning "
            "alone divides each loss by accumulate_grad_batches), so it is their exact mean"
        ),
    )
    _check_epoch_length(trainer, result, len(loader) if rows is not None else None)
    return result


def _check_epoch_length(trainer: pl.Trainer, plan: Plan, loader_length: int | None) -> None:
    """Refuse an epoch shorter than one optimizer step (warn when ``limit_train_batches``
    made it so): no step of it would reach the effective batch."""
    num_batches = trainer.num_training_batches
    steps = plan.gradient_accumulation_steps
    if not isinstance(num_batches, int) or num_batches >= steps:
        return
    whole = loader_length is not None and loader_length < steps  # the data itself is short
    if whole and plan.epoch is not None:
        reached = plan.epoch.last_effective_batch_size
    else:
        reached = num_batches * plan.micro_batch_size * plan.world_size
    message = (
        f"AutobatchFinder: an epoch has {num_batches} micro-batch(es) per rank "
        f"(num_training_batches), fewer than accumulate_grad_batches {steps}, so every "
        f"optimizer step ends the epoch with an effective batch of {reached}, never "
        f"effective_batch_size {plan.effective_batch_size}, and max_steps and LR schedules "
        "would count such steps"
    )
    if whole:
        raise ConfigError(
            f"{message}; give the dataset at least {plan.effective_batch_size} rows, or ask "
            f"for an effective_batch_size it can fill (at most {reached})"
        )
    logger.warning("%s (limit_train_batches shortened the epoch)", message)
