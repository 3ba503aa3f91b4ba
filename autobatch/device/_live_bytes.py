"""Count the bytes of live tensor storages while code runs, and their peak.

A ``TorchDispatchMode`` that registers the storage of every op's output and drops it when the
storage is freed (a weak reference's callback). The simulated device uses it on real CPU tensors
with a capacity; the estimator uses it on fake tensors, which have storages of the right size but
no memory. The same idea drives PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``
(a private API, so we keep this small tracker of our own).

Sizes are rounded up to ``rounding_bytes`` per storage (512 B by default: the CUDA caching
allocator's smallest block), so fake and simulated counts match a CUDA allocator's granularity.

Example::

    tracker = LiveBytes()
    tracker.add_resident(model.parameters())
    with tracker:
        model(x).sum().backward()
    tracker.peak_bytes
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CUDA_BLOCK_BYTES", "LiveBytes"]

CUDA_BLOCK_BYTES = 512
"""Smallest block of the CUDA caching allocator (``kMinBlockSize`` in
c10/cuda/CUDACachingAllocator.cpp)."""


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live and peak bytes of tensor storages created inside the mode, plus registered residents.

    Args:
        capacity_bytes: when set, an op whose output takes live bytes above it raises
            ``on_exceeded(requested_bytes, live_bytes)`` after dropping that output.
        on_exceeded: builds the exception to raise; required with ``capacity_bytes``.
        rounding_bytes: each storage counts as its size rounded up to a multiple of this.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        on_exceeded: Callable[[int, int], BaseException] | None = None,
        rounding_bytes: int = CUDA_BLOCK_BYTES,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if capacity_bytes is not None and on_exceeded is None:
            raise ValueError("on_exceeded is required with capacity_bytes")
        self.capacity_bytes = capacity_bytes
        self.on_exceeded = on_exceeded
        self._rounding = rounding_bytes
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self.live_bytes = 0
        """Bytes of storages alive now."""
        self.peak_bytes = 0
        """Most bytes alive at once since construction (one tracker per measured block)."""

    def add_resident(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before the mode was entered (weights, optimizer state...)."""
        for tensor in tensors:
            self._add(tensor)

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self._rounding) * self._rounding

    def _add(self, tensor: torch.Tensor) -> int:
        """Register the tensor's storage once; returns the bytes newly counted."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return 0
        nbytes = self._rounded(storage.nbytes())

        def forget(_ref: object, key: int = key, nbytes: int = nbytes) -> None:
            if self._live.pop(key, None) is not None:
                self.live_bytes -= nbytes

        self._live[key] = (weakref.ref(storage, forget), nbytes)
        self.live_bytes += nbytes
        return nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        added = 0
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                added += self._add(leaf)
        if self.capacity_bytes is not None and self.live_bytes > self.capacity_bytes:
            live = self.live_bytes - added
            del out, leaf  # an allocator that fails hands back no tensor
            assert self.on_exceeded is not None
            raise self.on_exceeded(added, live)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out
