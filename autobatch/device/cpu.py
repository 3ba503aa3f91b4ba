"""The host CPU as a device: real allocations, real allocation failures.

Capacity is the kernel's ``MemAvailable`` (``/proc/meminfo``) when queried. Peak bytes are
counted with :class:`~autobatch.device.live_bytes.LiveBytes`, since the CPU allocator keeps no
statistics; they include the resident tensors (weights, optimizer state), which ``MemAvailable``
already excludes, so the probe is conservative by their size. Linux overcommits memory, so a real
allocation failure would come late (swap, or the OOM killer): during a step the tracker raises
``torch.OutOfMemoryError`` as soon as live tensors would exceed what was available when the step
began, before the host runs out.

Example::

    device = CpuDevice()
    device.capacity().capacity_bytes
"""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from autobatch.device.live_bytes import LiveBytes
from autobatch.device.types import Capacity, PeakMemory

__all__ = ["CpuDevice", "read_meminfo"]


def read_meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """``(total_bytes, available_bytes)`` of host memory; falls back to sysconf without /proc."""
    try:
        fields = {}
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"], fields["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def _host_out_of_memory(requested_bytes: int, live_bytes: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(
        f"host memory would be exhausted: tried to allocate {requested_bytes} bytes with "
        f"{live_bytes} bytes of tensors live (CPU device, MemAvailable at step start)"
    )


class CpuDevice:
    """The host CPU; see the module docstring."""

    @property
    def name(self) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @property
    def type(self) -> str:
        return "cpu"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def driver_version(self) -> str:
        return ""

    def capacity(self) -> Capacity:
        total, available = read_meminfo()
        return Capacity(
            total_memory_bytes=total,
            capacity_bytes=available,
            foreign_memory_bytes=max(0, total - available),
        )

    @contextmanager
    def measure(self, resident: Sequence[torch.Tensor]) -> Iterator[PeakMemory]:
        _, available = read_meminfo()
        tracker = LiveBytes(rounding_bytes=1)
        tracker.add_resident(resident)
        tracker.capacity_bytes = available + tracker.live_bytes
        tracker.on_exceeded = _host_out_of_memory
        peak = PeakMemory()
        try:
            with tracker:
                yield peak
        finally:
            peak.allocated_bytes = peak.reserved_bytes = tracker.peak_bytes

    def release(self) -> None:
        gc.collect()

    def synchronize(self) -> None:
        return None
