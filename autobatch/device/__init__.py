"""The device boundary: everything the probe knows about memory goes through :class:`Device`.

Implementations: :class:`CudaDevice` (torch allocator statistics and NVML), :class:`CpuDevice`
(real allocation failures) and :class:`SimulatedDevice` (real step on the CPU, live tensor bytes
counted against a capacity, torch's ``OutOfMemoryError`` raised like the CUDA allocator does).
Foreign exceptions are classified in one place (``oom.is_oom``); NVML is read in one module
(``nvml``, the only one importing ``pynvml``), over the device set the process was given
(``visible``). What a job may use is a :class:`MemoryBudget`: every memory source the process
can see, combined by one pure rule (``budget``), on each :class:`Capacity`. A card named from
outside the job (an NVML reading of a local GPU, a Kubernetes node's GPU feature discovery
labels) gets its budget from :func:`budget_from_nvml` and :func:`budget_from_labels`, pure
(``card_budget``, ``node_labels``).

This face is what other layers, the service and the benchmarks import. The types and parsing
import eagerly; NVML, the devices and ``is_oom`` on first use (importing ``autobatch`` neither
loads NVML nor torch, and the service lists GPUs without torch).

Example::

    device = resolve_device("sim:2GiB")
    device.capacity().capacity_bytes      # 2147483648
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autobatch.device._budget import (
    MAX_GPU_FRACTION,
    MIN_GPU_FRACTION,
    SHARING_TOLERANCE,
    BudgetReading,
    BudgetSource,
    MemoryBudget,
    SharingMode,
    check_gpu_fraction,
    combine_budget,
    fraction_reading,
    gpu_fraction_reading,
    vgpu_limit_reading,
)
from autobatch.device._card_budget import (
    CardBudget,
    CardMemory,
    CardSource,
    budget_from_labels,
    budget_from_nvml,
)
from autobatch.device._card_names import card_key, same_card
from autobatch.device._catalogue import (
    CARD_MEMORY_TOLERANCE,
    CATALOGUE_MIB,
    catalogue_memory_bytes,
)
from autobatch.device._node import NODE_NAME_ENV_VARS, node_name
from autobatch.device._node_labels import LabelError, NodeDevice, read_node_labels
from autobatch.device._resolve import ParsedDevice, parse_device, resolve_device
from autobatch.device._types import (
    UNKNOWN_MEMORY,
    Capacity,
    Device,
    GpuInfo,
    MemoryInfo,
    MemorySource,
    PeakMemory,
)
from autobatch.extras import keeping_rng

if TYPE_CHECKING:
    from autobatch.device._cpu import CpuDevice
    from autobatch.device._cuda import CudaDevice
    from autobatch.device._live_bytes import LiveBytes
    from autobatch.device._nvml import REASONS, Nvml, default_nvml, list_gpus
    from autobatch.device._oom import is_oom
    from autobatch.device._simulated import SimulatedDevice
    from autobatch.device._visible import NvmlDevice, VisibleDevices, cuda_visible_devices

__all__ = [
    "CARD_MEMORY_TOLERANCE",
    "CATALOGUE_MIB",
    "MAX_GPU_FRACTION",
    "MIN_GPU_FRACTION",
    "NODE_NAME_ENV_VARS",
    "REASONS",
    "SHARING_TOLERANCE",
    "UNKNOWN_MEMORY",
    "BudgetReading",
    "BudgetSource",
    "Capacity",
    "CardBudget",
    "CardMemory",
    "CardSource",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "GpuInfo",
    "LabelError",
    "LiveBytes",
    "MemoryBudget",
    "MemoryInfo",
    "MemorySource",
    "NodeDevice",
    "Nvml",
    "NvmlDevice",
    "ParsedDevice",
    "PeakMemory",
    "SharingMode",
    "SimulatedDevice",
    "VisibleDevices",
    "budget_from_labels",
    "budget_from_nvml",
    "card_key",
    "catalogue_memory_bytes",
    "check_gpu_fraction",
    "combine_budget",
    "cuda_visible_devices",
    "default_nvml",
    "fraction_reading",
    "gpu_fraction_reading",
    "is_oom",
    "list_gpus",
    "node_name",
    "parse_device",
    "read_node_labels",
    "resolve_device",
    "same_card",
    "vgpu_limit_reading",
]

_LAZY_EXPORTS = {
    "CpuDevice": "autobatch.device._cpu",
    "CudaDevice": "autobatch.device._cuda",
    "LiveBytes": "autobatch.device._live_bytes",
    "REASONS": "autobatch.device._nvml",
    "Nvml": "autobatch.device._nvml",
    "NvmlDevice": "autobatch.device._visible",
    "SimulatedDevice": "autobatch.device._simulated",
    "VisibleDevices": "autobatch.device._visible",
    "cuda_visible_devices": "autobatch.device._visible",
    "default_nvml": "autobatch.device._nvml",
    "is_oom": "autobatch.device._oom",
    "list_gpus": "autobatch.device._nvml",
}

if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _LAZY_EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'autobatch.device' has no attribute {name!r}")
        with keeping_rng():  # a module imported on first use must not draw from `random`
            return getattr(importlib.import_module(module), name)
