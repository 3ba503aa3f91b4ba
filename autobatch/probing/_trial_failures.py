"""What a failed trial says: the errors and hints of :mod:`autobatch.probing._trials`.

Each message names the numbers and the fix: where a step did not fit (this rank or another), the
model's static footprint for a step that does not fit at micro-batch 1, a ``train_step`` that
never steps the optimizer, and hints for failures with a known cause (a ``train_step`` that
calls backward itself, a collective that needs what other ranks send while the probe fakes
them). Not public: use :func:`autobatch.probe`.

Example::

    raise StepFailedError(f"... {error}{failure_hint(exc, ranks=2)}", micro_batch_size=8)
"""

from __future__ import annotations

import pickle

import torch

from autobatch.conditions import Conditions
from autobatch.errors import ConfigError, Remedy
from autobatch.probing._live_conditions import precision_remedies
from autobatch.units import format_bytes

__all__ = [
    "FIXED_STATE_BINDS",
    "failure_hint",
    "needs_two_samples",
    "never_updated",
    "num_trainable",
    "on_rank",
    "resident_bytes",
    "static_bytes",
    "what_binds",
]


def never_updated(
    optimizer: torch.optim.Optimizer, *, size: int, calls: int, max_calls: int
) -> ConfigError:
    """The error for a warm-up whose ``train_step`` ran ``calls`` times at micro-batch ``size``
    and never stepped ``optimizer``."""
    name = type(optimizer).__name__
    return ConfigError(
        f"train_step ran {calls} times at micro-batch {size} and never called step() on the "
        f"optimizer passed as optimizer= ({name}), so its state (e.g. Adam's moments) never "
        "appeared and no measured step would include it. With step_includes_update=True "
        f"train_step must step that optimizer at least once every {max_calls} calls: "
        "pass the optimizer it steps, accumulate over fewer calls while probing, or pass "
        "step_includes_update=False (the probe then adds backward, optimizer.step() and "
        "zero_grad() around a train_step that returns the loss)"
    )


def on_rank(rank: int | None, ranks: int, own: int, device_name: str) -> str:
    """Where a step did not fit, for DoesNotFitError: this device, or rank N's."""
    if ranks == 1:
        return f"on {device_name}"
    if rank is None:
        return f"on {device_name} (or another of the {ranks} ranks)"
    if rank == own:
        return f"on {device_name} (rank {rank} of {ranks}: this rank)"
    return f"on rank {rank} (of {ranks}; this rank, {own}, probes {device_name})"


def needs_two_samples(exc: BaseException | None) -> bool:
    return exc is not None and "Expected more than 1 value per channel" in str(exc)


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside torch.distributed (on a fake backend, in a probe's
    step: ``recv`` from any source, for one, fails there as nowhere else)."""
    traceback = exc.__traceback__
    while traceback is not None:
        path = traceback.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in path:
            return True
        traceback = traceback.tb_next
    return False


def failure_hint(exc: BaseException, *, ranks: int = 1) -> str:
    """A fix for failures with a known cause, appended to the error message; ``ranks``: the
    ranks probing together."""
    if "backward through the graph a second time" in str(exc):
        return (
            "; does your train_step call backward() itself? Then pass step_includes_update=True "
            "(and let it step and zero the optimizer too)"
        )
    if ranks > 1 and (
        isinstance(exc, (EOFError, pickle.UnpicklingError))
        or "Backend fake" in str(exc)
        or _raised_in_torch_distributed(exc)
    ):
        return (
            "; while the probe runs a step, every process group's collectives go to a fake "
            "backend (no communication: a rank gets its own values back, and nothing from a "
            "broadcast_object_list or recv of another rank's; monitored_barrier is not "
            "supported), so that a rank out of memory leaves no other waiting in one. A "
            "train_step that needs what other ranks send cannot be probed as it is: move that "
            "collective out of the train_step you probe (log after the step, for example)"
        )
    return ""


def num_trainable(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes every step holds from start to end: weights, buffers and optimizer state."""
    weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    state = sum(
        v.untyped_storage().nbytes()
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return weights + state


def static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """:func:`resident_bytes` and the gradients."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return resident_bytes(model, optimizer) + grads


FIXED_STATE_BINDS = 0.9
"""The share of the capacity the fixed state (weights, gradients, optimizer state) takes from
which it, not the activations, is what does not fit: what is left is too little for a
micro-batch's activations and the optimizer step's temporaries (AdamW's update alone takes
about the weights' bytes again), and autocast or activation checkpointing, which shrink only
activations, cannot make room."""


def what_binds(
    static: int, capacity_bytes: int, conditions: Conditions
) -> tuple[str, tuple[Remedy, ...]]:
    """What does not fit at micro-batch 1, in words after the footprint, and the remedies that
    shrink it: the fixed state when it takes :data:`FIXED_STATE_BINDS` of the capacity or more
    (a larger device, an optimizer with less state, parameters stored in a smaller dtype where
    they are float32, a smaller model), else the activations (reduced precision first)."""
    smaller_model = Remedy(purpose="a smaller model")
    if static < FIXED_STATE_BINDS * capacity_bytes:
        return "", (
            Remedy(purpose="a larger device"),
            *precision_remedies(conditions),
            Remedy(purpose="a lighter optimizer"),
            smaller_model,
        )
    left = capacity_bytes - static
    room = (
        f"more than the {format_bytes(capacity_bytes)} capacity"
        if left <= 0
        else f"{static / capacity_bytes:.0%} of the capacity, leaving {format_bytes(left)} for "
        "activations and the optimizer step's temporaries"
    )
    why = (
        f": the fixed state alone takes {room}, and autocast and activation checkpointing "
        "shrink only activations"
    )
    stored = [r for r in precision_remedies(conditions) if not r.parameter]  # dtype of weights
    return why, (
        Remedy(purpose="a larger device"),
        Remedy(purpose="an optimizer that keeps less state (SGD none, AdamW two copies)"),
        *stored,
        smaller_model,
    )
