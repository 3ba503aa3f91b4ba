"""How a sample becomes one whole training step (docs/quickstart.md, "First runs from Python").

- ``train_step(model, batch) -> loss`` given: that is the step; backward, optimizer step and
  ``zero_grad`` are added around it unless ``step_includes_update=True``.
- a tuple/list ``(inputs, targets)`` with ``loss_fn``: ``loss_fn(model(inputs), targets)``;
- a dict: ``model(**batch)`` and the output's ``.loss`` (Hugging Face style), unless
  ``loss_fn(output, batch)`` is given;
- a single tensor: ``model(batch)`` reduced by ``loss_fn(output)``, or the output itself when it
  is a scalar.

Forward and loss run under ``torch.autocast`` when ``amp_dtype`` is set; with float16 a
``GradScaler`` scales the loss, as a mixed-precision training loop would.

Example::

    step = TrainingStep(model, optimizer, loss_fn=torch.nn.functional.cross_entropy)
    step.run((inputs, targets))     # forward, loss, backward, optimizer.step(), zero_grad()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any

import torch

from autobatch.errors import ConfigError

__all__ = [
    "LossFn",
    "MicroStepWindow",
    "OptimizerSteps",
    "TrainStep",
    "TrainingStep",
    "check_step_arguments",
]

LossFn = Callable[..., torch.Tensor]
TrainStep = Callable[[torch.nn.Module, Any], Any]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MicroStepWindow:
    """How one step runs as a window of gradient accumulation, as a loop that reduces once per
    window runs it (the probe's trials of a DDP or FSDP2 model). The default is one plain step.

    Example::

        window = MicroStepWindow(num_micro_steps=2, skip_sync=ddp.no_sync, lead_batch=small)
        TrainingStep(model, optimizer, loss_fn=loss_fn, window=window).run(batch)
    """

    num_micro_steps: int = 1
    """Forward and backward passes before the one optimizer step (each loss divided by it): the
    last on the step's batch, the ones before on ``lead_batch``."""
    skip_sync: Callable[[], AbstractContextManager[object]] | None = None
    """A context without the gradient reduction (DDP's ``no_sync()``, FSDP2's switch off),
    entered for every micro-step but the last; None: none."""
    lead_batch: Any = None
    """What the micro-steps before the last run on (None: the step's batch). The gradients they
    leave held (FSDP2's unsharded ones) are the parameters' size whatever the batch's, so a small
    one measures the same peak for less time."""


class TrainingStep:
    """One training step of ``model`` on a batch: forward, loss, backward, step, zero_grad.

    Args:
        model: the module, already on its device.
        optimizer: stepped once per call.
        loss_fn: see module docstring.
        train_step: the user's own step returning the loss (a scalar tensor).
        step_includes_update: ``train_step`` already runs backward, step and zero_grad.
        amp_dtype: autocast dtype (``torch.float16`` / ``torch.bfloat16``), None for full precision.
        grad_scaler: a ``torch.amp.GradScaler`` to use (the probe passes its own); None for none.
        step_on_overflow: with a scaler, step the optimizer even when the scaled gradients
            overflowed (a training loop would skip that step). The probe measures memory: a
            skipped step would leave the optimizer state uncreated, and every measurement short
            of it.
        window: the step as a window of gradient accumulation (:class:`MicroStepWindow`);
            None: one forward and backward pass, then the update.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn | None = None,
        train_step: TrainStep | None = None,
        step_includes_update: bool = False,
        amp_dtype: torch.dtype | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        step_on_overflow: bool = False,
        window: MicroStepWindow | None = None,
    ) -> None:
        if step_includes_update and train_step is None:
            raise ConfigError("step_includes_update=True needs train_step=...; pass your step")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_step = train_step
        self.step_includes_update = step_includes_update
        self.amp_dtype = amp_dtype
        self.grad_scaler = grad_scaler
        self.step_on_overflow = step_on_overflow
        self.window = MicroStepWindow() if window is None else window

    def loss(self, batch: Any) -> torch.Tensor:
        """Forward and loss (under autocast when set); a scalar tensor.

        Raises:
            ConfigError: the batch's form needs a ``loss_fn`` that was not given, or the loss is
                not a scalar tensor.
        """
        device_type = _device_type(self.model)
        enabled = self.amp_dtype is not None
        with torch.autocast(device_type=device_type, dtype=self.amp_dtype, enabled=enabled):
            loss = self._forward_loss(batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(
                f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in "
                "loss_fn or train_step"
            )
        return loss

    def evaluate(self, batch: Any) -> None:
        """One evaluation step under ``torch.inference_mode`` (and autocast when set): the
        forward, and the loss when the step's form gives one (``train_step``, ``loss_fn``, or a
        Hugging Face model that computes it from labels); nothing is kept. The caller puts the
        model in eval mode.

        Raises:
            ConfigError: a tuple/list batch that is not ``(inputs, targets)``, or a
                ``train_step`` that updates by itself.
        """
        if self.step_includes_update:
            raise ConfigError(
                "an evaluation step cannot run a train_step that updates by itself "
                "(step_includes_update=True); pass one that returns the loss, with "
                "step_includes_update=False"
            )
        model, loss_fn = self.model, self.loss_fn
        enabled = self.amp_dtype is not None
        with (
            torch.inference_mode(),
            torch.autocast(_device_type(model), dtype=self.amp_dtype, enabled=enabled),
        ):
            if self.train_step is not None:
                self.train_step(model, batch)
            elif isinstance(batch, Mapping):
                output = model(**batch)
                if loss_fn is not None:
                    loss_fn(output, batch)
            elif isinstance(batch, tuple | list):
                if len(batch) != 2:
                    raise ConfigError(
                        f"a {type(batch).__name__} sample of {len(batch)} items needs the form "
                        "(inputs, targets); or pass train_step=..."
                    )
                inputs, targets = batch
                output = model(inputs)
                if loss_fn is not None:
                    loss_fn(output, targets)
            else:
                output = model(batch)
                if loss_fn is not None:
                    loss_fn(output)

    def _forward_loss(self, batch: Any) -> Any:
        model, loss_fn = self.model, self.loss_fn
        if self.train_step is not None:
            return self.train_step(model, batch)
        if isinstance(batch, Mapping):
            output = model(**batch)
            if loss_fn is not None:
                return loss_fn(output, batch)
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, Mapping):
                loss = output.get("loss")
            if loss is None:
                raise ConfigError(
                    f"model output ({type(output).__name__}) has no .loss; put labels in the "
                    "sample (e.g. 'labels') or pass loss_fn=lambda output, batch: ..."
                )
            return loss
        if isinstance(batch, tuple | list):
            if loss_fn is None or len(batch) != 2:
                raise ConfigError(
                    f"a {type(batch).__name__} sample of {len(batch)} items needs the form "
                    "(inputs, targets) and loss_fn=...: loss_fn(model(inputs), targets); or pass "
                    "train_step=..."
                )
            inputs, targets = batch
            return loss_fn(model(inputs), targets)
        output = model(batch)
        if loss_fn is not None:
            return loss_fn(output)
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return output
        loss = getattr(output, "loss", None)
        if loss is not None:
            return loss
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ConfigError(
            f"model(sample) returned {shape}, not a scalar loss; pass loss_fn=... that reduces "
            "the output to a scalar (e.g. lambda out: out.float().pow(2).mean())"
        )

    def run(self, batch: Any) -> float:
        """The whole step (``num_micro_steps`` forward and backward passes, then the update);
        returns the last loss value (a float, nothing kept alive)."""
        if self.step_includes_update:
            return _value(self.loss(batch).detach())
        window = self.window
        num = window.num_micro_steps
        for index in range(num):
            leading = index < num - 1
            with window.skip_sync() if window.skip_sync is not None and leading else nullcontext():
                lead = window.lead_batch
                loss = self.loss(lead if leading and lead is not None else batch)
                value = loss.detach()
                if num > 1:
                    loss = loss / num
                if self.grad_scaler is not None:
                    loss = self.grad_scaler.scale(loss)
                loss.backward()  # type: ignore[no-untyped-call]
                del loss
        if self.grad_scaler is not None:
            if self.step_on_overflow:
                self.grad_scaler.unscale_(self.optimizer)
                self.optimizer.step()
            else:
                self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _value(value)


class OptimizerSteps:
    """Counts the calls of ``optimizer.step()`` inside a ``with`` block, through a step post-hook
    on that optimizer alone, removed when the block exits (nothing is left on the optimizer).

    Args:
        optimizer: the optimizer to watch.

    Example::

        with OptimizerSteps(optimizer) as updates:
            step.run(batch)
        updates.count   # 0 when the step accumulated gradients without updating
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.count = 0
        """``optimizer.step()`` calls completed inside the block so far."""
        self._handle: Any = None

    def __enter__(self) -> OptimizerSteps:
        self._handle = self.optimizer.register_step_post_hook(self._stepped)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._handle.remove()
        self._handle = None

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1


def _device_type(model: torch.nn.Module) -> str:
    for tensor in model.parameters():
        return tensor.device.type
    return "cpu"


def _value(loss: torch.Tensor) -> float:
    """The loss as a float; 0.0 on fake tensors, which have no value."""
    from torch._subclasses.fake_tensor import FakeTensor

    return 0.0 if isinstance(loss, FakeTensor) else float(loss)


def check_step_arguments(
    model: torch.nn.Module,
    optimizer: object,
    *,
    step_includes_update: bool,
    amp_dtype: object,
) -> None:
    """Refuse arguments that would probe the wrong step or touch state the probe cannot restore.

    Raises:
        ConfigError: names the argument and the fix.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model {model!r} is not a torch.nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer {optimizer!r} is not a torch.optim.Optimizer; pass the optimizer object "
            "you train with (or None for AdamW)"
        )
    if step_includes_update and optimizer is None:
        raise ConfigError(
            "step_includes_update=True needs optimizer=...: your train_step steps an optimizer "
            "the probe must know, to count its state and restore it afterwards"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        params = {id(p) for p in model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if params and not any(id(p) in params for p in held):
            raise ConfigError(
                "the optimizer holds none of the model's parameters; pass the optimizer built "
                "over this model (e.g. torch.optim.AdamW(model.parameters()))"
            )
    if amp_dtype is not None and amp_dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            f"amp_dtype {amp_dtype!r} is not an autocast dtype; use torch.bfloat16, "
            "torch.float16, or None for full precision"
        )
