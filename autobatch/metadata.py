"""What a Profile records about the model, inputs and backend, and the model fingerprint.

Example::

    model_fingerprint(torch.nn.Linear(4, 2))    # 'b1946ac92492d234'
"""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime

import torch

__all__ = ["backend_flags", "model_fingerprint", "now_iso", "param_dtype"]


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
