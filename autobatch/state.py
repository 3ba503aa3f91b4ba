"""Leave no trace: snapshot what a probe may change, in host memory, and put it back bitwise.

Covers the model's parameters and buffers (BatchNorm running statistics), gradients, every
module's train/eval flag, the optimizer's state and hyperparameters, and the RNG states of Python,
NumPy (when imported), torch's CPU generator and every initialised CUDA device.

Example::

    snapshot = Snapshot.take(model, optimizer)
    ...                      # trials that step the optimizer
    snapshot.restore()       # bitwise what it was
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["Snapshot"]


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


@dataclasses.dataclass(kw_only=True, slots=True)
class Snapshot:
    """Host copies of a model's and optimizer's state, and the RNG states."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[torch.Tensor, torch.Tensor | None]]
    flags: list[tuple[torch.nn.Module, bool]]
    optimizer_state: dict[str, Any] | None
    rng: dict[str, Any]

    @classmethod
    def take(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """Copy everything to host memory (uses as many host bytes as the model's state)."""
        params: list[torch.Tensor] = list(model.parameters())
        tensors = [(t, _to_host(t)) for t in [*params, *model.buffers()]]
        grads = [(p, None if p.grad is None else _to_host(p.grad)) for p in params]
        flags = [(m, m.training) for m in model.modules()]
        state = None if optimizer is None else tree_map(_to_host, optimizer.state_dict())
        return cls(
            model=model,
            optimizer=optimizer,
            tensors=tensors,
            grads=grads,
            flags=flags,
            optimizer_state=state,
            rng=_rng_state(),
        )

    def restore(self) -> None:
        """Write every saved value back in place (same tensor objects, so references stay valid)."""
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
            for param, grad in self.grads:
                param.grad = None if grad is None else grad.to(param.device)
        for module, training in self.flags:
            module.training = training
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(self.optimizer_state)
        _set_rng_state(self.rng)


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
