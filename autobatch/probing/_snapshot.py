"""Leave no trace: snapshot what a probe may change, in host memory, and put it back bitwise.

Covers the parameters and buffers of the model (BatchNorm running statistics) and every parameter
the optimizer holds (also ones outside the model), their gradients, every module's train/eval
flag, the optimizer's per-parameter state (restored with its own dtypes, in place where the tensor
still exists) and hyperparameters, and the RNG states of Python, NumPy (when imported), torch's
CPU generator and every initialised CUDA device.

Parameters, buffers and surviving optimizer-state tensors keep their identity; gradients are new
tensors with the saved values (the probe frees gradients between trials, as ``zero_grad`` does).

Example::

    snapshot = Snapshot.take(model, optimizer)
    ...                      # trials that step the optimizer
    snapshot.restore()       # bitwise what it was
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Snapshot", "objects_frozen", "preserved_rng", "resident_tensors"]

_OPTIMIZER_FLAGS = ("_opt_called",)
"""Optimizer attributes torch's LR schedulers set on the first step; restored too."""


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


@dataclasses.dataclass(kw_only=True, slots=True)
class Snapshot:
    """Host copies of a model's and optimizer's state, and the RNG states."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[torch.Tensor, torch.Tensor | None]]
    flags: list[tuple[torch.nn.Module, bool]]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: dict[torch.Tensor, dict[str, tuple[Any, torch.device | None]]]
    param_groups: list[dict[str, Any]]
    optimizer_flags: dict[str, Any]
    rng: dict[str, Any]

    @classmethod
    def take(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """Copy everything to host memory (uses as many host bytes as the state)."""
        params: list[torch.Tensor] = list(model.parameters())
        if optimizer is not None:
            seen = {id(p) for p in params}
            for group in optimizer.param_groups:
                params += [p for p in group["params"] if id(p) not in seen]
                seen.update(id(p) for p in group["params"])
        tensors = [(t, _to_host(t)) for t in [*params, *model.buffers()]]
        grads = [(p, None if p.grad is None else _to_host(p.grad)) for p in params]
        state: dict[torch.Tensor, dict[str, tuple[Any, torch.device | None]]] = {}
        groups: list[dict[str, Any]] = []
        flags: dict[str, Any] = {}
        if optimizer is not None:
            for param, per_param in optimizer.state.items():
                state[param] = {
                    key: (_to_host(v), v.device if isinstance(v, torch.Tensor) else None)
                    for key, v in per_param.items()
                }
            groups = [
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                for g in optimizer.param_groups
            ]
            flags = {k: getattr(optimizer, k) for k in _OPTIMIZER_FLAGS if hasattr(optimizer, k)}
        return cls(
            tensors=tensors,
            grads=grads,
            flags=[(m, m.training) for m in model.modules()],
            optimizer=optimizer,
            optimizer_state=state,
            param_groups=groups,
            optimizer_flags=flags,
            rng=_rng_state(),
        )

    def restore(self) -> None:
        """Write every saved value back (see the module docstring for what keeps identity)."""
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
            for param, grad in self.grads:
                param.grad = None if grad is None else grad.to(param.device)
        for module, training in self.flags:
            module.training = training
        if self.optimizer is not None:
            self._restore_optimizer(self.optimizer)
        _set_rng_state(self.rng)

    def _restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for param in [p for p in optimizer.state if p not in self.optimizer_state]:
            del optimizer.state[param]
        for param, saved in self.optimizer_state.items():
            current = optimizer.state[param]
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, (value, device) in saved.items():
                existing = current.get(key)
                if isinstance(value, torch.Tensor):
                    if (
                        isinstance(existing, torch.Tensor)
                        and existing.shape == value.shape
                        and existing.dtype == value.dtype
                        and existing.device == device
                    ):
                        with torch.no_grad():
                            existing.copy_(value)
                    else:
                        current[key] = value.to(device)
                else:
                    current[key] = copy.deepcopy(value)
        for group, saved_group in zip(optimizer.param_groups, self.param_groups, strict=True):
            group.update(copy.deepcopy(saved_group))
        for key in _OPTIMIZER_FLAGS:
            if key in self.optimizer_flags:
                setattr(optimizer, key, self.optimizer_flags[key])
            elif hasattr(optimizer, key):
                delattr(optimizer, key)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def objects_frozen() -> Iterator[None]:
    """Objects that existed before the block are left out of garbage collection while it runs.

    The probe collects garbage after every trial (a failed step's frames hold its tensors); each
    full collection walks every object of torch and of whatever framework is imported
    (transformers or Lightning add hundreds of thousands), which can outweigh a small model's
    steps. What a probe must free is all created inside the block. Skipped when the process
    already froze objects (``gc.freeze()`` is process-wide and unfreezing would undo the
    caller's); the freeze is undone on leaving, so the process's collector is as it was.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block (e.g. the user's ``n -> batch`` function) without moving any RNG."""
    state = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(state)


def resident_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """Tensors alive between training steps: parameters, buffers, gradients, optimizer state.
    A device that counts tensors itself (simulated, CPU) starts each step's count from these."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return [*model.parameters(), *model.buffers(), *grads, *state]
