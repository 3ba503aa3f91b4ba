"""What a Profile records about the model, inputs and backend: the step's identity.

Example::

    model_fingerprint(torch.nn.Linear(4, 2))    # 'b1946ac92492d234'
    step_identity(model, BatchSource.from_sample(x), None).cache_key(
        device_name="sim", total_memory_bytes=2**30)
"""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime

import torch

from autobatch.batch import BatchSource
from autobatch.profile import StepIdentity

__all__ = [
    "backend_flags",
    "model_fingerprint",
    "now_iso",
    "param_dtype",
    "step_fingerprint",
    "step_identity",
]


def model_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits of SHA-256 over the model's class and its parameters' and buffers' names,
    shapes, dtypes and ``requires_grad``. Equal architectures share it; weights do not matter."""
    digest = hashlib.sha256(type(model).__module__.encode() + type(model).__qualname__.encode())
    for name, param in model.named_parameters():
        digest.update(
            f"p:{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode()
        )
    for name, buffer in model.named_buffers():
        digest.update(f"b:{name}:{tuple(buffer.shape)}:{buffer.dtype};".encode())
    return digest.hexdigest()[:16]


def param_dtype(model: torch.nn.Module) -> str:
    """Dtype of the first floating-point parameter, e.g. ``"float32"``; ``""`` without one."""
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return ""


def backend_flags() -> dict[str, str]:
    """Backend state that changes a step's peak memory; part of a profile's cache key."""
    return {
        "cudnn.benchmark": str(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": str(torch.backends.cudnn.deterministic),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")
        ),
    }


def now_iso() -> str:
    """The current UTC time, ISO-8601 to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def _callable_id(function: object) -> str:
    """Name and code of a function (lambdas included), or the type and repr of a callable object."""
    if function is None:
        return "-"
    code = getattr(function, "__code__", None)
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    if code is not None:
        return f"{name}:{hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()}"
    return f"{type(function).__module__}.{type(function).__qualname__}:{function!r}"


def step_fingerprint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    loss_fn: object = None,
    train_step: object = None,
    step_includes_update: bool = False,
) -> str:
    """16 hex digits of SHA-256 over how a training step is formed: the loss function or train
    step (name and bytecode), ``step_includes_update``, the optimizer's class, hyperparameters and
    parameter groups (count and size), and the bytecode of each module class's ``forward``
    (so switching on gradient checkpointing in code changes it). Part of the cache key."""
    digest = hashlib.sha256()
    digest.update(f"loss={_callable_id(loss_fn)};step={_callable_id(train_step)};".encode())
    digest.update(f"update={step_includes_update};".encode())
    if optimizer is None:
        digest.update(b"optimizer=AdamW(defaults);")
    else:
        defaults = sorted((k, repr(v)) for k, v in optimizer.defaults.items())
        digest.update(f"optimizer={type(optimizer).__qualname__}{defaults};".encode())
        for group in optimizer.param_groups:
            settings = sorted((k, repr(v)) for k, v in group.items() if k != "params")
            size = sum(p.numel() for p in group["params"])
            digest.update(f"group:{len(group['params'])}:{size}:{settings};".encode())
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        forward = getattr(cls, "forward", None)
        code = getattr(forward, "__code__", None)
        body = code.co_code if code is not None else b""
        digest.update(cls.__qualname__.encode() + hashlib.sha256(body).digest())
    return digest.hexdigest()[:16]


def step_identity(
    model: torch.nn.Module,
    source: BatchSource,
    optimizer: torch.optim.Optimizer | None,
    *,
    loss_fn: object = None,
    train_step: object = None,
    step_includes_update: bool = False,
    amp_dtype: torch.dtype | None = None,
) -> StepIdentity:
    """The one builder of a step's :class:`~autobatch.profile.StepIdentity`, shared by the probe,
    the estimate and ``autotune`` (so a profile's cache key is the one its request looks up).

    Args:
        model: the model (its fingerprint and parameter dtype).
        source: the micro-batch source (one sample's shapes and dtypes).
        optimizer: the user's optimizer; None stands for the default AdamW.
        loss_fn, train_step, step_includes_update: how the step is formed.
        amp_dtype: autocast dtype, None without AMP.
    """
    return StepIdentity(
        model_fingerprint=model_fingerprint(model),
        step_fingerprint=step_fingerprint(
            model,
            optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
        ),
        input_shape=dict(source.sample_shapes),
        input_dtypes=dict(source.sample_dtypes),
        dtype=param_dtype(model),
        amp_dtype=str(amp_dtype).removeprefix("torch.") if amp_dtype is not None else "",
        optimizer=type(optimizer).__name__ if optimizer is not None else "AdamW",
        torch_version=torch.__version__,
        backend_flags=backend_flags(),
    )
