"""The device boundary's types: :class:`Device` (the protocol every device implements) and the
memory readings it returns, in bytes.

Implementations: :class:`~autobatch.device._cuda.CudaDevice` (torch allocator statistics and
NVML), :class:`~autobatch.device._cpu.CpuDevice` (real allocation failures) and
:class:`~autobatch.device._simulated.SimulatedDevice` (real step on the CPU, live tensor bytes
counted against a capacity, torch's ``OutOfMemoryError`` raised like the CUDA allocator does).
Foreign exceptions are classified in one place, :mod:`autobatch.device._oom`.

Example::

    capacity = device.capacity()          # a Capacity, in bytes
    capacity.capacity_bytes <= capacity.total_memory_bytes
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from autobatch.device._budget import MemoryBudget

if TYPE_CHECKING:
    import torch

__all__ = [
    "UNKNOWN_MEMORY",
    "Capacity",
    "Device",
    "GpuInfo",
    "MemoryInfo",
    "MemorySource",
    "PeakMemory",
]


MemorySource = Literal["nvml", "cuda_runtime", "host", "unknown"]
"""Where a :class:`MemoryInfo` came from: NVML, ``torch.cuda.mem_get_info`` (the CUDA runtime),
the host's memory (a unified-memory board), or nowhere (the numbers are None)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryInfo:
    """A device's memory as the driver reports it, in bytes; None where it is not known.

    A total of 0 from NVML is "unknown", never a capacity of 0: such a reading has
    ``total_memory_bytes`` None.
    """

    total_memory_bytes: int | None
    free_memory_bytes: int | None
    """Bytes free for new allocations (never computed as total minus used)."""
    used_memory_bytes: int | None
    """Bytes used by processes (NVML v2: excluding the driver's reserve)."""
    reserved_memory_bytes: int | None = None
    """Bytes the driver reserves for itself (NVML v2 only; None when not reported)."""
    used_includes_reserved: bool = False
    """True when ``used`` counts the driver's reserve too (NVML's v1 memory API, the CUDA
    runtime), so ``reserved_memory_bytes`` is None rather than a measured 0."""
    memory_source: MemorySource = "nvml"
    unified_memory: bool = False
    """The GPU shares the host's memory (e.g. GB10): the numbers are the host's available
    memory, which the CPU side uses too."""


UNKNOWN_MEMORY = MemoryInfo(
    total_memory_bytes=None,
    free_memory_bytes=None,
    used_memory_bytes=None,
    memory_source="unknown",
)
"""The reading of a GPU whose memory neither NVML, the CUDA runtime nor the host reports."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GpuInfo:
    """One GPU (or MIG instance) as NVML lists it."""

    nvml_index: int
    """NVML's index (physical order, ignores ``CUDA_VISIBLE_DEVICES``)."""
    cuda_index: int | None
    """The index CUDA gives it in the device set this process was given (``NVIDIA_VISIBLE_DEVICES``,
    then ``CUDA_VISIBLE_DEVICES``, ordered by ``CUDA_DEVICE_ORDER``); None when not in it."""
    uuid: str
    name: str
    memory: MemoryInfo
    is_mig: bool = False
    """True for a MIG instance (its memory is the slice's own)."""
    parent_uuid: str = ""
    """For a MIG instance, the UUID of the physical GPU."""
    mig_profile: str = ""
    """For a MIG instance, its profile name, e.g. ``"3g.40gb"``."""
    given: bool = True
    """In the device set the container was given (``NVIDIA_VISIBLE_DEVICES``). False for the
    other cards NVML sees in a privileged pod: listed, never planned on."""
    memory_reason: str = ""
    """Why ``memory`` is unknown or not NVML's, as a stable reason code (``not_supported``,
    ``no_permission``, ``gpu_lost``, ``zero_total``...); empty when NVML read it."""
    memory_detail: str = ""
    """The message behind ``memory_reason``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Capacity:
    """What a probe may use on a device, in bytes."""

    total_memory_bytes: int
    """The device's total memory."""
    capacity_bytes: int
    """Bytes this process may still take: the smallest of its memory budget's sources (on CUDA:
    free memory plus what torch already reserved, capped by every limit it can see)."""
    foreign_memory_bytes: int = 0
    """Bytes held by other processes (and the driver) at the time of the query."""
    budget: MemoryBudget | None = None
    """Every source of ``capacity_bytes`` (NVML, the CUDA runtime, vGPU limits, fractions, the
    cgroup), the one that decided, and the sharing mode; None for a device that does not say."""


@dataclasses.dataclass(kw_only=True, slots=True)
class PeakMemory:
    """Filled in by :meth:`Device.measure` when its block exits."""

    allocated_bytes: int = 0
    """Peak bytes of live tensors during the block (including resident ones)."""
    reserved_bytes: int = 0
    """Peak bytes the allocator held from the device; equals ``allocated_bytes`` without a cache."""


@runtime_checkable
class Device(Protocol):
    """A device the probe can measure a training step on.

    ``measure`` brackets one step: it resets peak statistics, and on exit (normal or not) fills the
    :class:`PeakMemory` it yielded. ``resident`` names the tensors that exist before the step
    (:func:`autobatch.probing._snapshot.resident_tensors`: parameters, buffers, gradients, optimizer
    state;
    not the batch, which the step builds inside the block, so the block counts it); devices that
    count tensors themselves (simulated) add them to the count, devices with allocator
    statistics ignore it.
    """

    @property
    def name(self) -> str: ...

    @property
    def type(self) -> str:
        """``"cuda"``, ``"cpu"`` or ``"sim"``."""
        ...

    @property
    def torch_device(self) -> torch.device: ...

    @property
    def driver_version(self) -> str: ...

    def capacity(self) -> Capacity: ...

    def measure(self, resident: Sequence[torch.Tensor]) -> AbstractContextManager[PeakMemory]: ...

    def release(self) -> None:
        """Free what a finished (or failed) step left cached: ``gc.collect()`` first, then the
        allocator cache; resets peak statistics."""
        ...

    def synchronize(self) -> None: ...

    def clock(self) -> float:
        """Seconds on a monotonic clock, for the probe's timings and its choice of road
        (``time.perf_counter()`` on real devices; a simulated device may count its real steps
        at a set cost instead)."""
        ...

    @property
    def steps_scale_with_size(self) -> bool:
        """Whether a real step's time grows in proportion to its micro-batch from the smallest
        sizes on (a CPU, compute-bound from one sample), rather than staying near the time of
        a step at micro-batch 1 (a GPU's small steps, bound by kernel launches; a simulated
        card that counts each step at a set cost). The probe prices the real steps an estimate
        saves with it."""
        ...
