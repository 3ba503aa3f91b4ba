"""Read the conditions that move a step's memory from the live process: the one reader
(:func:`read_conditions`) of :class:`~autobatch.conditions.Conditions`.

What is read, and from where (never from the flags a caller passed, except where noted):

- allocator: the settings torch applied, read back with
  ``torch._C._accelerator_getAllocatorSettings()`` (torch 2.13: the string torch parsed from
  ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` the first time it read them, or the last
  one set through ``torch.cuda.memory._set_allocator_settings``; torch reads the environment
  once, so a variable changed later is not in effect); a torch without it gives
  ``PYTORCH_CUDA_ALLOC_CONF`` as set, said so. The backend from
  ``torch.cuda.memory.get_allocator_backend()`` (CUDA builds). Both variable names as set, and
  whether CUDA was initialised, beside them;
- ``torch.backends.cudnn``'s ``enabled``, ``benchmark`` and ``deterministic``;
- the parameters' and gradients' bytes by dtype, resident on this device (a DTensor's shard,
  padded as FSDP2 allocates it), and the trainable elements;
- activation checkpointing: Hugging Face's ``gradient_checkpointing`` flags (with the checkpoint
  function's settings), ``checkpoint_wrapper`` modules, the composable ``checkpoint`` API,
  the blocks this library checkpoints (:mod:`autobatch.probing._checkpointing`);
- the optimizer's class, and its state's bytes by dtype once it has state (the probe reads it
  again after its first optimizer step: :func:`with_optimizer_state`);
- the AMP dtype (the one the step autocasts to: the caller's, as the probe runs it) and the
  data-parallel size with its source (:func:`autobatch.distributed._layout.resolve_world_size`).

Example::

    conditions = read_conditions(model, optimizer, device_type="cuda", amp_dtype=torch.bfloat16)
    conditions.parameter_bytes      # {"bfloat16": 248_000_000}
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Iterable

import torch

from autobatch.conditions import (
    ALLOCATOR_VARIABLES,
    Conditions,
    condition_changes,
    launcher_world_size,
    normalized_allocator_settings,
)
from autobatch.errors import ConditionsWarning, ConfigError, Remedy
from autobatch.planning import Plan
from autobatch.probing._checkpointing import describe_applied
from autobatch.units import format_bytes

__all__ = [
    "UNKNOWN_AMP",
    "check_plan_here",
    "live_world_size",
    "precision_remedies",
    "process_conditions",
    "read_conditions",
    "with_optimizer_state",
]

UNKNOWN_AMP = "unknown"
"""``amp_dtype`` for a reader that cannot tell whether the step autocasts (a training loop)."""

DEFAULT_OPTIMIZER = "torch.optim.adamw.AdamW"
"""What a probe given no optimizer steps (see :func:`autobatch.probe`)."""


def read_conditions(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    device_type: str,
    amp_dtype: torch.dtype | str | None,
    sourced_world_size: tuple[int, str] | None = None,
) -> Conditions:
    """The live process's conditions for a step of ``model`` with ``optimizer``.

    Args:
        model: the model as it trains (sharded, cast, frozen as it will be).
        optimizer: the optimizer it steps; None stands for the probe's own AdamW.
        device_type: the device the step runs on (``"cuda"``, ``"cpu"``, ``"sim"``, ``"fake"``).
        amp_dtype: the autocast dtype, None for none, or :data:`UNKNOWN_AMP`.
        sourced_world_size: the data-parallel size and where it came from; None when unknown.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    process = process_conditions(device_type=device_type, sourced_world_size=sourced_world_size)
    return with_optimizer_state(
        dataclasses.replace(
            process,
            amp_dtype=_amp(amp_dtype),
            parameter_bytes=_bytes_by_dtype(model.parameters()),
            gradient_bytes=_bytes_by_dtype(trainable),
            num_parameters=sum(_resident_numel(p) for p in model.parameters()),
            num_trainable_parameters=sum(_resident_numel(p) for p in trainable),
            activation_checkpointing=activation_checkpointing(model),
            optimizer=_qualified(optimizer) if optimizer is not None else DEFAULT_OPTIMIZER,
        ),
        optimizer,
    )


def process_conditions(
    *, device_type: str = "", sourced_world_size: tuple[int, str] | None = None
) -> Conditions:
    """The conditions of this process alone, without a model: the allocator, cuDNN and the
    data-parallel size (what ``autobatch.plan(profile)`` can compare; the rest stays unknown).

    ``device_type`` empty reads them for no device in particular (a comparison uses the
    recorded side's device).
    """
    environment = {name: os.environ[name] for name in ALLOCATOR_VARIABLES if name in os.environ}
    read_back = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if callable(read_back):
        settings, source = str(read_back()), "torch"
    else:  # torch before 2.9: CUDA read PYTORCH_CUDA_ALLOC_CONF only
        settings, source = environment.get("PYTORCH_CUDA_ALLOC_CONF", ""), "environment"
    backend = getattr(torch._C, "_cuda_getAllocatorBackend", None)
    size, where = sourced_world_size if sourced_world_size is not None else (0, "")
    return Conditions(
        device_type=device_type or "any",
        allocator_settings=normalized_allocator_settings(settings),
        allocator_source=source,
        allocator_backend=str(backend()) if callable(backend) else "",
        allocator_environment=environment,
        cuda_initialized=bool(torch.cuda.is_initialized()),  # type: ignore[no-untyped-call]
        cudnn={
            "benchmark": str(bool(torch.backends.cudnn.benchmark)),
            "deterministic": str(bool(torch.backends.cudnn.deterministic)),
            "enabled": str(bool(torch.backends.cudnn.enabled)),
        },
        world_size=size,
        world_size_source=where,
    )


def check_plan_here(
    plan: Plan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    where: str,
    amp_dtype: torch.dtype | str | None = UNKNOWN_AMP,
    sourced_world_size: tuple[int, str] | None = None,
    stacklevel: int = 3,
) -> None:
    """Compare ``plan``'s conditions with the live process where a training loop starts (the
    Accumulator, the framework drop-ins): the one comparison,
    :func:`autobatch.conditions.condition_changes`.

    Args:
        plan: the plan the loop runs.
        model, optimizer: what the loop trains and steps.
        where: who checks, for the messages (``"Accumulator"``).
        amp_dtype: the loop's autocast dtype, None for none, or :data:`UNKNOWN_AMP`.
        sourced_world_size: the loop's data-parallel size and its source; None: not compared.
        stacklevel: of the warnings, pointing at the caller's caller.

    Warns:
        ConditionsWarning: one per condition that moves memory and differs (the step may not
            fit at the plan's micro-batch), naming both values and the fix.

    Raises:
        ConfigError: the plan's world size is not the loop's data-parallel size (the effective
            batch would not be the one planned).
    """
    live = read_conditions(
        model,
        optimizer,
        device_type=plan.conditions.device_type or "any",
        amp_dtype=amp_dtype,
        sourced_world_size=sourced_world_size,
    )
    changes = condition_changes(
        plan.conditions, live, world_size=plan.world_size if sourced_world_size else None
    )
    for change in changes:
        if change.kind == "batch":
            raise ConfigError(
                f"{where}: the plan ({plan.formula()}) does not hold in this process: "
                f"{change.describe()}"
            )
    for change in changes:
        warnings.warn(
            f"{where}: micro-batch {plan.micro_batch_size} was measured under other conditions "
            f"than this process's, so it may not fit: {change.describe()}",
            ConditionsWarning,
            stacklevel=stacklevel,
        )


def precision_remedies(conditions: Conditions) -> list[Remedy]:
    """Ways to a smaller step by precision that are not already in effect: autocast to bfloat16
    when the step runs without AMP; under AMP, parameters stored in the AMP dtype when some are
    float32 (a model loaded without a dtype keeps fp32 weights, gradients and optimizer state
    whatever autocast computes in); none when both are in place."""
    amp = conditions.amp_dtype
    if amp == "off":
        return [Remedy(parameter="amp_dtype", values=("bfloat16",), purpose="reduced precision")]
    float32 = conditions.parameter_bytes.get("float32", 0)
    if not amp or not float32:
        return []
    return [
        Remedy(
            purpose=f"parameters stored in {amp}: {format_bytes(float32)} of them are float32, "
            f"and autocast to {amp} computes in it without storing them so (load them with "
            f"from_pretrained(torch_dtype=torch.{amp}) or model.to(torch.{amp}))"
        )
    ]


def live_world_size() -> tuple[int, str]:
    """The data-parallel size this process trains with, as far as it can tell without a model:
    the default process group's size, else the launcher's ``WORLD_SIZE``, else one process.

    Raises:
        ConfigError: ``WORLD_SIZE`` is not an int >= 1.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), "the default process group"
    return launcher_world_size(os.environ) or (1, "one process (no launcher, no process group)")


def with_optimizer_state(
    conditions: Conditions, optimizer: torch.optim.Optimizer | None
) -> Conditions:
    """``conditions`` with the optimizer state's bytes by dtype and its main dtype, read from
    ``optimizer`` when it has state (unchanged otherwise: unknown before its first step)."""
    if optimizer is None or not optimizer.state:
        return conditions
    tensors = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    by_dtype = _bytes_by_dtype(tensors)
    if not by_dtype:
        return conditions
    return dataclasses.replace(
        conditions,
        optimizer_state_bytes=by_dtype,
        optimizer_state_dtype=max(by_dtype, key=lambda dtype: by_dtype[dtype]),
    )


def activation_checkpointing(model: torch.nn.Module) -> str:
    """What recomputes activations in ``model``'s backward, as far as its modules say:
    ``"none detected"`` or a description (see :attr:`Conditions.activation_checkpointing`)."""
    found = []
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if flagged:
        function = next(
            (
                m.__dict__["_gradient_checkpointing_func"]
                for m in flagged
                if "_gradient_checkpointing_func" in m.__dict__
            ),
            None,
        )
        found.append(
            f"Hugging Face gradient_checkpointing on {len(flagged)} modules"
            + (f" ({_describe_function(function)})" if function is not None else "")
        )
    wrapped = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
    if wrapped:
        found.append(f"checkpoint_wrapper around {len(wrapped)} modules")
    composable = _composable_checkpoints(model)
    if composable:
        found.append(f"torch.distributed._composable.checkpoint on {composable} modules")
    applied = describe_applied(model)
    if applied:
        found.append(applied)
    return "; ".join(found) or "none detected"


def _composable_checkpoints(model: torch.nn.Module) -> int:
    try:
        from torch.distributed._composable.checkpoint_activation import checkpoint
    except ImportError:  # pragma: no cover - torch without distributed
        return 0
    return sum(checkpoint.state(m) is not None for m in model.modules())


def _describe_function(function: object) -> str:
    """A checkpoint function as text the same in any process: its qualified name and, for a
    ``functools.partial``, its keyword arguments (``use_reentrant=True``)."""
    settings = ""
    if isinstance(function, functools.partial):
        settings = "".join(f", {k}={v!r}" for k, v in sorted(function.keywords.items()))
        function = function.func
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    return name + settings


def _amp(amp_dtype: torch.dtype | str | None) -> str:
    if amp_dtype is None:
        return "off"
    if amp_dtype == UNKNOWN_AMP:
        return ""
    return str(amp_dtype).removeprefix("torch.")


def _qualified(instance: object) -> str:
    cls = type(instance)
    return f"{cls.__module__}.{cls.__qualname__}"


def _resident_numel(tensor: torch.Tensor) -> int:
    """Elements of ``tensor`` resident on this device: for a DTensor, its shard padded to the
    largest rank's (as FSDP2 allocates them), so that every rank reads the same number (a
    profile's cache key must be the same on every rank); else all of them."""
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None:
        return tensor.numel()
    shape = list(tensor.shape)
    for ranks, placement in zip(mesh.shape, placements, strict=True):
        if placement.is_shard():
            shape[placement.dim] = -(-shape[placement.dim] // ranks)
    return math.prod(shape)


def _bytes_by_dtype(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    found: dict[str, int] = {}
    for tensor in tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        found[dtype] = found.get(dtype, 0) + _resident_numel(tensor) * tensor.element_size()
    return dict(sorted(found.items()))
