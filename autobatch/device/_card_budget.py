"""The memory budget of a card named from outside the job: an NVML reading of a local GPU, or a
Kubernetes node's GPU feature discovery labels.

PURE: plain values in (a :class:`~autobatch.device.GpuInfo` already read, the labels, an
environment mapping), a :class:`CardBudget` out; no torch, no pynvml, no I/O. The service plans
for such a card (its ``POST /v1/plan`` device); a job that runs on the card reads its own
(:class:`~autobatch.device.CudaDevice`, which also sees the CUDA runtime). A size given by the
caller is :func:`autobatch.planning.given_budget`'s.

The readings, in order (:func:`~autobatch.device.combine_budget` takes the smallest):

- from NVML: the card's total or free memory (``memory``), the vGPU and MPS limit variables
  of its ``cuda_index`` in ``environ`` (``CUDA_DEVICE_MEMORY_LIMIT_<i>``,
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), the declared
  ``gpu_fraction`` of its total;
- from labels: the card (or MIG slice, :func:`~autobatch.device.read_node_labels`), its share
  under the device plugin's time-slicing (``1 / replicas``; under its MPS strategy the
  ``mps_limit`` each client gets), the declared ``gpu_fraction``.

Either way the job's CUDA runtime is out of sight (a sharing layer such as HAMi limits it inside
the job's container): the budget names it among its ``unseen_sources``, with a warning.

Example::

    card = budget_from_labels(
        {"nvidia.com/gpu.memory": "24576", "nvidia.com/gpu.replicas": "4"},
        mig_profile=None,
        gpu_fraction=None,
        gpus=[],
    )
    card.budget.budget_bytes, card.budget.deciding_source    # (6442450944, 'time_slicing')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from autobatch.device._budget import (
    BudgetReading,
    MemoryBudget,
    check_gpu_fraction,
    combine_budget,
    gpu_fraction_reading,
    vgpu_limit_reading,
)
from autobatch.device._mps import mps_limit_reading
from autobatch.device._node_labels import LabelError, read_node_labels
from autobatch.device._types import GpuInfo, MemorySource
from autobatch.errors import ConfigError, DeviceUnavailableError
from autobatch.units import format_bytes

__all__ = ["CardBudget", "CardMemory", "CardSource", "budget_from_labels", "budget_from_nvml"]

CardSource = Literal["nvml", "node_labels", "capacity_bytes"]
"""What named a card: a local GPU's NVML reading, node labels, or a size given."""
CardMemory = Literal["total", "free"]
"""Which of a local GPU's NVML numbers a plan is for: its total memory (the job will own the
card) or what is free now."""

_UNSEEN = ("cuda_runtime",)
"""A card read from outside the job never sees the job's CUDA runtime."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CardBudget:
    """A card's memory budget and what an answer shows about the card."""

    budget: MemoryBudget
    """Every reading and the smallest of them (``budget.budget_bytes``)."""
    source: CardSource
    """What named the card: a local GPU's NVML reading, node labels, or a size given."""
    name: str | None = None
    """NVML's or GFD's product name (``-MIG-<profile>`` appended for a labelled slice)."""
    uuid: str | None = None
    """NVML's UUID (``GPU-...`` or ``MIG-...``); None for labels."""
    cuda_index: int | None = None
    """CUDA's index in the device set the reader was given; None outside it or for labels."""
    mig_profile: str | None = None
    """The MIG slice's profile (e.g. ``"1g.5gb"``); None for a whole card."""
    memory_source: MemorySource | None = None
    """Where the local GPU's memory numbers came from (``"nvml"``, ``"cuda_runtime"``,
    ``"host"``); None for labels."""
    memory_held_by_others_bytes: int | None = None
    """Bytes other processes hold on the local GPU now (NVML's ``used``)."""
    note: str | None = None
    """Set when a budget of the card's total memory assumes that what others hold now will be
    gone when the job runs."""
    warnings: tuple[str, ...] = ()
    """What was corrected in reading the card (a memory label in bytes, NVML over a label)."""


def budget_from_nvml(
    gpu: GpuInfo,
    *,
    memory: CardMemory,
    gpu_fraction: float | None,
    environ: Mapping[str, str],
) -> CardBudget:
    """The budget of a local GPU from one NVML reading of it.

    Args:
        gpu: the GPU (or MIG instance) as NVML read it.
        memory: plan for its ``"total"`` memory (the job will own the card) or what is
            ``"free"`` now.
        gpu_fraction: the declared share of the card (0 < x <= 1) of its total memory, or None.
        environ: where the vGPU limit variables are read (the reader's environment).

    Returns:
        The :class:`CardBudget` (readings ``nvml``, then ``vgpu_limit``, ``mps_limit`` and
        ``gpu_fraction`` when set).

    Raises:
        DeviceUnavailableError: ``reason="memory_unknown"``: NVML could not read the card's
            total or free memory, or a vGPU or MPS limit variable is not a memory limit (then the
            limit, so the budget, is unknown); ``reason="no_free_memory"``: the memory planned
            for (``memory``) is 0 bytes.
        ConfigError: ``gpu_fraction`` is not in (0, 1].
    """
    fraction = check_gpu_fraction(gpu_fraction)
    held = gpu.memory.used_memory_bytes
    total, free = gpu.memory.total_memory_bytes, gpu.memory.free_memory_bytes
    if total is None or free is None:
        raise DeviceUnavailableError(
            f"the memory of GPU {gpu.uuid} is unknown ({gpu.memory_reason}: "
            f"{gpu.memory_detail}); plan with device.capacity_bytes instead",
            reason="memory_unknown",
        )
    capacity = total if memory == "total" else free
    if capacity < 1:
        raise DeviceUnavailableError(f"GPU {gpu.uuid} has no free memory", reason="no_free_memory")
    readings = [
        BudgetReading(
            source="nvml",
            total_bytes=total,
            available_bytes=min(capacity, total),
            free_bytes=min(free, total),
            detail=f'{gpu.name} {gpu.uuid}, memory "{memory}"',
        )
    ]
    try:
        if gpu.cuda_index is not None:
            for limit in (
                vgpu_limit_reading(environ, gpu.cuda_index),
                mps_limit_reading(environ, cuda_index=gpu.cuda_index, uuid=gpu.uuid),
            ):
                if limit is not None:
                    readings.append(limit)
    except ConfigError as exc:
        raise DeviceUnavailableError(str(exc), reason="memory_unknown") from exc
    if fraction is not None:
        readings.append(gpu_fraction_reading(fraction, total))
    return CardBudget(
        budget=combine_budget(readings, unseen_sources=_UNSEEN),
        source="nvml",
        name=gpu.name,
        uuid=gpu.uuid,
        cuda_index=gpu.cuda_index,
        mig_profile=gpu.mig_profile or None,
        memory_source=gpu.memory.memory_source,
        memory_held_by_others_bytes=held,
        note=_held_note(gpu) if memory == "total" and held else None,
    )


def _held_note(gpu: GpuInfo) -> str:
    """What a budget of the card's total memory assumes about the memory others hold now."""
    held = gpu.memory.used_memory_bytes or 0
    reserve = (
        ", the driver's reserve included (NVML's v1 memory API does not separate it)"
        if gpu.memory.used_includes_reserved
        else ""
    )
    return (
        f"other processes hold {format_bytes(held)} ({held} bytes{reserve}) on this GPU now; "
        'this plan for memory "total" assumes they will be gone when the job runs; plan '
        'with memory "free" to leave room for them'
    )


def budget_from_labels(
    labels: Mapping[str, str],
    *,
    mig_profile: str | None,
    gpu_fraction: float | None,
    gpus: Sequence[GpuInfo],
) -> CardBudget:
    """The budget of the card (or MIG slice) a node's GPU feature discovery labels describe:
    the card, its share under the device plugin's time-slicing, and the declared fraction.

    Args:
        labels: the node's labels (``kubectl get node -o json``'s ``metadata.labels``).
        mig_profile: the MIG profile the job gets (e.g. ``"1g.5gb"``), or None for a whole GPU.
        gpu_fraction: the declared share of the card (0 < x <= 1), or None.
        gpus: the node's GPUs as the reader sees them (NVML corrects a wrong memory label);
            empty without NVML or on another node.

    Returns:
        The :class:`CardBudget` (readings ``node_labels``, then ``time_slicing`` for more than
        one replica, ``mps_limit`` instead under the ``mps`` sharing strategy, and
        ``gpu_fraction`` when declared), with the labels' warnings.

    Raises:
        LabelError: a label is missing or unreadable, the MIG slice is not named or unknown
            (see :func:`~autobatch.device.read_node_labels`); or the labels say the card is
            shared but not among how many jobs and no ``gpu_fraction`` says the share
            (``field="gpu_fraction"``).
        ConfigError: ``gpu_fraction`` is not in (0, 1].
    """
    fraction = check_gpu_fraction(gpu_fraction)
    labelled = read_node_labels(labels, mig_profile=mig_profile, gpus=gpus)
    card = labelled.capacity_bytes
    if labelled.shared and labelled.replicas == 1 and fraction is None:
        raise LabelError(
            "the node labels say its GPUs are shared (a '-SHARED' product or a sharing strategy) "
            "but not among how many jobs (no nvidia.com/gpu.replicas label), so a job's share "
            "of the card is unknown and it is never planned as the whole card: give "
            "gpu_fraction (1 / the number of replicas), or device.capacity_bytes",
            field="gpu_fraction",
        )
    readings = [
        BudgetReading(
            source="node_labels",
            total_bytes=card,
            available_bytes=card,
            detail=f"{labelled.name or 'GPU'} from the node's labels",
        )
    ]
    if labelled.replicas > 1:
        share = card // labelled.replicas
        strategy = labelled.sharing_strategy or "time-slicing"
        # Under its MPS strategy the device plugin limits each client to the share (the limit
        # a job reads from CUDA_MPS_PINNED_DEVICE_MEM_LIMIT); time-slicing isolates nothing.
        mps = strategy == "mps"
        isolation = "each client limited to its share" if mps else "no memory isolation"
        readings.append(
            BudgetReading(
                source="mps_limit" if mps else "time_slicing",
                total_bytes=share,
                available_bytes=share,
                detail=f"the device plugin shares each card among {labelled.replicas} replicas "
                f"({strategy}, {isolation} between them): 1/{labelled.replicas} of it",
            )
        )
    if fraction is not None:
        readings.append(gpu_fraction_reading(fraction, card))
    return CardBudget(
        budget=combine_budget(readings, unseen_sources=_UNSEEN),
        source="node_labels",
        name=labelled.name,
        mig_profile=mig_profile,
        warnings=labelled.warnings,
    )
