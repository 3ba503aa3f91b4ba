"""Models that fail above a size for reasons the measured peaks do not show (real GPUs do:
workspaces, fragmentation, kernel launch limits). Fake-tensor steps (the estimate) never fail, so
the estimate sees nothing coming. Also a CLI factory
(``tests.helpers.probe_stubs:launch_limited``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

LAUNCH_LIMIT = "CUDA error: invalid configuration argument"
ALLOCATOR_ASSERT = (
    'NVML_SUCCESS == r INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":830, '
    "please report a bug to PyTorch. "
)


class FailsAbove(nn.Module):
    """A small MLP whose real forward raises ``error()`` at micro-batches above ``threshold``.

    ``extra_activation``: a factor of the activations allocated and kept for backward by real
    steps only (> 0: the estimate is that many times optimistic about activations) or by fake
    steps only (< 0: pessimistic).
    """

    def __init__(
        self,
        threshold: int | None = None,
        error: Callable[[], Exception] = lambda: torch.OutOfMemoryError("CUDA out of memory."),
        *,
        width: int = 64,
        extra_activation: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.threshold = threshold
        self.error = error
        self.extra_activation = extra_activation
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = isinstance(x, FakeTensor)
        if not fake and self.threshold is not None and x.shape[0] > self.threshold:
            raise self.error()
        out = self.layer(x)
        extra = self.extra_activation
        if (extra > 0 and not fake) or (extra < 0 and fake):
            kept = out
            for _ in range(abs(extra)):  # each sin keeps its input for backward
                kept = torch.sin(kept)
            out = out + kept * 0
        return out.pow(2).mean()


def launch_limited() -> nn.Module:
    """CLI factory: fails with CUDA's launch-limit error above 300 samples."""
    return FailsAbove(300, lambda: RuntimeError(LAUNCH_LIMIT), width=16)
