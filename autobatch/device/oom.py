"""Which exceptions mean "out of memory": the one place foreign errors are classified.

OOM, for the probe's purposes, is torch's ``OutOfMemoryError`` (CUDA caching allocator, and our
simulated device), allocation failures that surface from cuBLAS/cuDNN as ``RuntimeError`` text, and
the CPU allocator's failure. Everything else (shape errors, device-side asserts, CUDA's "invalid
configuration argument" from kernel launch limits at very large batches) is not OOM and must
propagate: treating it as "too big" would silently shrink the batch.

Example::

    try:
        step(n)
    except Exception as exc:
        if not is_oom(exc):
            raise
"""

from __future__ import annotations

import torch

__all__ = ["OOM_MESSAGES", "is_oom"]

OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "DefaultCPUAllocator: can't allocate memory",
    "HIP out of memory",
)
"""Substrings of ``RuntimeError`` messages that are allocation failures."""


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is an allocation failure (see module docstring for the list)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(pattern in message for pattern in OOM_MESSAGES)
    return False
