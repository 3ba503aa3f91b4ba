"""OOM classification: the table from the field."""

from __future__ import annotations

import pytest
import torch

from autobatch.device.oom import is_oom


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"), True),
        (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 8 GB"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (MemoryError(), True),
        (RuntimeError("CUDA error: invalid configuration argument"), False),
        (RuntimeError("CUDA error: device-side assert triggered"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (ValueError("Expected input batch_size (4) to match target batch_size (3)."), False),
        (KeyError("out of memory"), False),
    ],
)
def test_is_oom(exc: BaseException, expected: bool) -> None:
    assert is_oom(exc) is expected
