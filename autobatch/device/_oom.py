"""Which exceptions mean "out of memory": the one place foreign errors are classified.

OOM, for the probe's purposes, is torch's ``OutOfMemoryError`` (CUDA caching allocator, and our
simulated device), Python's ``MemoryError``, and a ``RuntimeError`` whose text is an allocation
failure: every backend's "... out of memory" (CUDA, HIP, XPU, MPS), cuBLAS/cuDNN allocation
failures, cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED`` (what cuDNN answers when a batch is too large
for its workspace), the CPU and Gaudi (HPU) allocators, and the CUDA caching allocator's own
``NVML_SUCCESS == r INTERNAL ASSERT FAILED`` (it fires in the allocator's out-of-memory path, seen
on MIG slices). This covers every message PyTorch Lightning's ``is_oom_error`` and Hugging Face
Accelerate's ``should_reduce_batch_size`` match. Everything else (shape errors, device-side
asserts, CUDA's "invalid configuration argument" from kernel launch limits at very large batches)
is not OOM and must not be read as one: treating it as "too big" would silently shrink the batch.
The probe treats such a failure above a size that passed as an upper bound instead.

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
    "out of memory",  # CUDA, HIP, XPU ("... out of memory."), MPS ("MPS backend out of memory")
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
    "PT_DEVMEM Allocation failed",  # Habana Gaudi (HPU)
)
"""Substrings of ``RuntimeError`` messages that are allocation failures."""

_ALLOCATOR_ASSERTION = ("NVML_SUCCESS", "INTERNAL ASSERT FAILED", "CUDACachingAllocator")
"""Every part of the caching allocator's NVML assertion, raised instead of an OOM."""


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is an allocation failure (see module docstring for the list)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(pattern in message for pattern in OOM_MESSAGES) or all(
            part in message for part in _ALLOCATOR_ASSERTION
        )
    return False
