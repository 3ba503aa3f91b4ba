"""The host CPU as a device: real allocations, real allocation failures.

Capacity is the memory budget of two sources, the smaller deciding: the host's ``MemAvailable``
(``/proc/meminfo``) and, in a container, its cgroup's memory limit less its working set
(:mod:`autobatch.device._cgroup`, v2 and v1); a host with 24 GB available inside a container
allowed 8 GiB budgets the 8 GiB. Peak bytes are
counted with :class:`~autobatch.device._live_bytes.LiveBytes`, since the CPU allocator keeps no
statistics; they include the resident tensors (weights, optimizer state), which the budget
already excludes, so the probe is conservative by their size. Linux overcommits memory, so a real
allocation failure would come late (swap, or the OOM killer, which a cgroup limit calls): during
a step the tracker raises ``torch.OutOfMemoryError`` as soon as live tensors would exceed the
budget when the step began, before the host or the container runs out.

Example::

    device = CpuDevice()
    device.capacity().budget.deciding_source      # "host", or "cgroup" in a limited container
"""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from autobatch.device._budget import BudgetReading, MemoryBudget, combine_budget
from autobatch.device._cgroup import cgroup_reading
from autobatch.device._live_bytes import LiveBytes
from autobatch.device._types import Capacity, PeakMemory

__all__ = ["CpuDevice", "read_meminfo"]


FS_ROOT = Path("/")
"""Where :class:`CpuDevice` reads ``proc/meminfo``, ``proc/self/cgroup`` and ``sys/fs/cgroup``
by default; one name tests can patch (or pass ``root=``)."""


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
        f"{live_bytes} bytes of tensors live (CPU device, its memory budget at step start)"
    )


class CpuDevice:
    """The host CPU; see the module docstring.

    Args:
        root: the file tree to read the host's and the cgroup's memory from; None is
            :data:`FS_ROOT` (``/``).
    """

    def __init__(self, *, root: Path | None = None) -> None:
        self._root = root

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

    def _budget(self) -> MemoryBudget:
        """The host's available memory and the cgroup's limit, read now (see the module
        docstring)."""
        root = FS_ROOT if self._root is None else self._root
        total, available = read_meminfo(root / "proc/meminfo")
        readings = [
            BudgetReading(
                source="host",
                total_bytes=total,
                available_bytes=min(available, total),
                free_bytes=min(available, total),
                detail="MemTotal and MemAvailable of /proc/meminfo",
            )
        ]
        limit = cgroup_reading(root)
        if limit is not None:
            readings.append(limit)
        return combine_budget(readings)

    def capacity(self) -> Capacity:
        budget = self._budget()
        host = budget.readings[0]
        return Capacity(
            total_memory_bytes=host.total_bytes,
            capacity_bytes=min(budget.budget_bytes, host.total_bytes),
            foreign_memory_bytes=max(0, host.total_bytes - host.available_bytes),
            budget=budget,
        )

    @contextmanager
    def measure(self, resident: Sequence[torch.Tensor]) -> Iterator[PeakMemory]:
        available = self._budget().budget_bytes
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

    def clock(self) -> float:
        return time.perf_counter()

    @property
    def steps_scale_with_size(self) -> bool:
        return True  # compute-bound from one sample
