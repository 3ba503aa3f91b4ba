"""Failure patterns the measured peaks do not predict, for ``bench/probe_vs_peers.py``: a model
whose real steps fail above a size (an OOM the peaks do not show, as cuBLAS/cuDNN workspaces and
fragmentation cause on real cards; CUDA's "invalid configuration argument" from a kernel's launch
limit), and a model whose estimate is off by 5x (activations kept only by the real step, or only
by the fake one). Fake-tensor steps never fail, so the estimate sees nothing coming.

The true max of each pattern is measured, not assumed: a bisection over real steps on the same
simulated device (every pattern is monotone in the size by construction, so bisection is exact),
any exception counting as a failure.

Example::

    pattern = PATTERNS[0]
    result, profile = run_autobatch(pattern.case, pattern.device(), max_micro_batch_size=20_000)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autobatch import SimulatedDevice
from autobatch.device import Device
from autobatch.probing import BatchSource, TrainingStep
from bench._cases import MIB, Case

__all__ = ["LAUNCH_LIMIT", "PATTERNS", "FailsAbove", "Pattern", "true_max"]

LAUNCH_LIMIT = "CUDA error: invalid configuration argument"


def _oom() -> Exception:
    # Worded like the CUDA allocator's message, so Lightning's and Accelerate's checks see it.
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


class FailsAbove(nn.Module):
    """A small MLP whose real forward raises ``error()`` at micro-batches above ``threshold``;
    ``extra`` more copies of its activations are kept for backward by real steps only (> 0) or
    by fake steps only (< 0), so the estimate is that far off."""

    def __init__(
        self,
        threshold: int | None,
        error: Callable[[], Exception] = _oom,
        *,
        width: int = 64,
        extra: int = 0,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.error = error
        self.extra = extra
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = isinstance(x, FakeTensor)
        if not fake and self.threshold is not None and x.shape[0] > self.threshold:
            raise self.error()
        out = self.layer(x)
        if (self.extra > 0 and not fake) or (self.extra < 0 and fake):
            kept = out
            for _ in range(abs(self.extra)):  # each sin keeps its input for backward
                kept = torch.sin(kept)
            out = out + kept * 0
        return out


def _square(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Pattern:
    """A failure pattern: the case every tool searches, on a fresh simulated card each."""

    name: str
    case: Case
    capacity_bytes: int
    limit: int
    """``max_micro_batch_size`` given to autobatch (the peers take no limit)."""

    def device(self) -> SimulatedDevice:
        return SimulatedDevice(capacity_bytes=self.capacity_bytes)


def _pattern(
    name: str, build: Callable[[], nn.Module], *, capacity_bytes: int, limit: int
) -> Pattern:
    case = Case(
        name=name,
        build_model=build,
        build_sample=lambda: torch.randn(4, 64),
        loss_fn=_square,
    )
    return Pattern(name=name, case=case, capacity_bytes=capacity_bytes, limit=limit)


PATTERNS: tuple[Pattern, ...] = (
    _pattern("oom-above-37", lambda: FailsAbove(37), capacity_bytes=1024 * MIB, limit=20_000),
    _pattern("oom-above-1000", lambda: FailsAbove(1000), capacity_bytes=1024 * MIB, limit=20_000),
    _pattern(
        "launch-limit-300",
        lambda: FailsAbove(300, lambda: RuntimeError(LAUNCH_LIMIT)),
        capacity_bytes=1024 * MIB,
        limit=1 << 16,
    ),
    _pattern(
        "estimate-5x-low", lambda: FailsAbove(None, extra=5), capacity_bytes=MIB, limit=1 << 16
    ),
    _pattern(
        "estimate-5x-high", lambda: FailsAbove(None, extra=-5), capacity_bytes=MIB, limit=1 << 16
    ),
)


def true_max(pattern: Pattern, device: Device) -> int:
    """The largest size whose real step runs and fits, by bisection over ``1..limit`` (exact for
    a failure pattern monotone in the size), after a warm-up step that creates the optimizer
    state."""
    model, sample, optimizer = pattern.case.build(device.torch_device)
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=pattern.case.loss_fn)
    source = BatchSource.from_sample(sample)
    step.run(source.make(1))

    def runs(size: int) -> bool:
        state = [v for s in optimizer.state.values() for v in s.values()]
        try:
            with device.measure([*model.parameters(), *state]):
                step.run(source.make(size))
        except Exception:  # any failure, OOM or not, bounds the sizes that run
            for param in model.parameters():
                param.grad = None
            return False
        return True

    lo, hi = 0, pattern.limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if runs(mid) else (lo, mid)
    return lo
