"""OOM classification: the table from the field, and every message the peers match."""

from __future__ import annotations

import pytest
import torch

from autobatch.device._oom import is_oom

ALLOCATOR_ASSERT = (
    'NVML_SUCCESS == r INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":830, '
    "please report a bug to PyTorch. "
)

TABLE: list[tuple[BaseException, bool]] = [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),  # Lightning: "CUDA" + "out of memory"
    (RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"), True),  # Accelerate
    (RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"), True),  # Accelerate
    (RuntimeError("MPS backend out of memory (MPS allocated: 9.00 GB)"), True),  # Accelerate
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if"), True),
    (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 8 GB"), True),
    (RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for 1.0 GB"), True),
    (RuntimeError(ALLOCATOR_ASSERT), True),  # MIG slices: the allocator's OOM path asserts
    (
        RuntimeError(
            "NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "
            '"../c10/cuda/CUDACachingAllocator.cpp":813, please report a bug to PyTorch.'
        ),
        True,
    ),
    (MemoryError(), True),
    (RuntimeError("CUDA error: invalid configuration argument"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError('t.is_cuda() INTERNAL ASSERT FAILED at "../aten/src/Foo.cpp":12'), False),
    (RuntimeError('NVML_SUCCESS == r INTERNAL ASSERT FAILED at "CUDAGraph.cpp":9'), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
    (ValueError("Expected input batch_size (4) to match target batch_size (3)."), False),
    (KeyError("out of memory"), False),
]


@pytest.mark.parametrize(("exc", "expected"), TABLE)
def test_is_oom(exc: BaseException, expected: bool) -> None:
    assert is_oom(exc) is expected


def test_every_message_lightning_calls_oom_is_oom() -> None:
    memory = pytest.importorskip("lightning.pytorch.utilities.memory")
    theirs = [exc for exc, _ in TABLE if memory.is_oom_error(exc)]
    assert len(theirs) >= 4  # CUDA, "CUDA error: out of memory", cuDNN, CPU
    assert all(is_oom(exc) for exc in theirs)


def test_every_message_accelerate_calls_oom_is_oom() -> None:
    memory = pytest.importorskip("accelerate.utils.memory")
    theirs = [exc for exc, _ in TABLE if memory.should_reduce_batch_size(exc)]
    assert len(theirs) >= 7  # CUDA, HIP, XPU, MPS, cuDNN, CPU, HPU
    assert all(is_oom(exc) for exc in theirs)
