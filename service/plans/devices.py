"""The device a ``POST /v1/plan`` plans for and its memory budget: a size given in bytes,
Kubernetes GPU feature discovery labels, or a local GPU read from NVML (one function each).

A local GPU is one of the cards this container was given (``NVIDIA_VISIBLE_DEVICES``, then
``CUDA_VISIBLE_DEVICES``; ``cuda_index`` is CUDA's number in that set), read through
``service.devices.gpus``: off the event loop, 503 ``nvml_timeout``/``gpu_lost`` rather than a wait.
Labels are ``nvidia.com/gpu.memory`` in MiB, or a MIG slice's ``nvidia.com/mig-<profile>.memory``
with ``mig_profile`` (:func:`autobatch.device.read_node_labels`).

The device's memory is a budget (``autobatch.device.MemoryBudget``, on the plan as
``plan.budget``), built by ``autobatch.device`` (by the planner for a size given): the device's
own memory (NVML's total or free, the labels' card, or the size given), then device-plugin
replicas (a time-sliced card is never planned whole), a vGPU limit variable in this service's
environment (``CUDA_DEVICE_MEMORY_LIMIT_<cuda_index>``), and a declared ``gpu_fraction``; the
smallest decides. A job's CUDA runtime, where a sharing layer such as HAMi limits its container,
is out of the service's sight: the budget says so (``unseen_sources``, and a warning).

Example::

    device, budget = await resolve_device(body.device, state.gpus, body.declared_fraction)
"""

from __future__ import annotations

import os

from autobatch.device import (
    CardBudget,
    LabelError,
    MemoryBudget,
    budget_from_labels,
    budget_from_nvml,
)
from autobatch.errors import DeviceUnavailableError
from service.devices.gpus import GpuMonitor, Inventory
from service.plans.planner import declared_budget
from service.web.problems import Problem
from service.web.schemas import DeviceSpec, ResolvedDevice
from service.web.wording import describe

__all__ = ["resolve_device"]


async def resolve_device(
    spec: DeviceSpec, gpus: GpuMonitor, gpu_fraction: float | None
) -> tuple[ResolvedDevice, MemoryBudget]:
    """The device planned for and its memory budget; the device's ``capacity_bytes`` is the
    budget's.

    Args:
        spec: the request's device (exactly one way of naming it).
        gpus: this node's GPUs, read off the event loop.
        gpu_fraction: the share of the device's memory declared for the job, or None.

    Raises:
        Problem: 422 for an unknown GPU, unreadable labels or no free memory; 503 when the
            GPU's memory (or its vGPU limit) is unknown.
    """
    if spec.capacity_bytes is not None:
        budget = declared_budget(spec.capacity_bytes, gpu_fraction=gpu_fraction)
        return _resolved(CardBudget(budget=budget, source="capacity_bytes")), budget
    if spec.node_labels is not None:
        card = await _labelled_card(spec, gpus, gpu_fraction)
        return _resolved(card), card.budget
    return await _local_gpu(spec, gpus, gpu_fraction)


async def _labelled_card(
    spec: DeviceSpec, gpus: GpuMonitor, gpu_fraction: float | None
) -> CardBudget:
    """The card that the node's labels describe (matched with the GPUs NVML sees, if any).

    Raises:
        Problem: 422 naming the label (or ``gpu_fraction``) that cannot be read.
    """
    assert spec.node_labels is not None
    try:
        seen = [reading.gpu for reading in (await gpus.snapshot())[1]]
    except DeviceUnavailableError:
        seen = []  # a central instance, or no driver: the labels alone
    try:
        return budget_from_labels(
            spec.node_labels, mig_profile=spec.mig_profile, gpu_fraction=gpu_fraction, gpus=seen
        )
    except LabelError as exc:
        field = "body.gpu_fraction" if exc.field == "gpu_fraction" else f"body.device.{exc.field}"
        raise Problem(422, "validation", describe(exc), field=field) from None


async def _local_gpu(
    spec: DeviceSpec, gpus: GpuMonitor, gpu_fraction: float | None
) -> tuple[ResolvedDevice, MemoryBudget]:
    """One of this container's GPUs (``cuda_index`` or ``uuid``), read from NVML.

    Raises:
        Problem: 422 ``unknown-device`` or ``no-free-memory``; 503 ``memory-unknown``.
    """
    reading, inventory = await gpus.reading_for(cuda_index=spec.cuda_index, uuid=spec.uuid)
    if spec.cuda_index is not None:
        field, wanted = "body.device.cuda_index", f"cuda_index {spec.cuda_index}"
    else:
        field, wanted = "body.device.uuid", f"uuid {spec.uuid!r}"
    if reading is None:
        raise _unknown_gpu(spec, inventory, wanted=wanted, field=field)
    try:
        card = budget_from_nvml(
            reading.gpu, memory=spec.memory, gpu_fraction=gpu_fraction, environ=os.environ
        )
    except DeviceUnavailableError as exc:
        if exc.reason == "no_free_memory":
            raise Problem(
                422, "no-free-memory", describe(exc), field="body.device.memory"
            ) from None
        raise Problem(503, "memory-unknown", describe(exc), field=field) from None
    device = _resolved(
        card, sampled_at=reading.sampled_at, age_seconds=round(reading.age_seconds(), 3)
    )
    return device, card.budget


def _unknown_gpu(spec: DeviceSpec, inventory: Inventory, *, wanted: str, field: str) -> Problem:
    """422 ``unknown-device``: the GPUs this container was given, and whether NVML sees the
    one asked for outside that set."""
    visible = ", ".join(
        f"{device.cuda_index}: {device.uuid}"
        for device in inventory.devices
        if device.cuda_index is not None
    )
    not_given = any(device.uuid == spec.uuid and not device.given for device in inventory.devices)
    why = " (NVML sees it, but this container was not given it)" if not_given else ""
    return Problem(
        422,
        "unknown-device",
        f"this node has no GPU with {wanted}{why} (visible: {visible or 'none'})",
        field=field,
    )


def _resolved(card: CardBudget, **reading: float) -> ResolvedDevice:
    """The device as the answer shows it: its capacity is the budget's, with the deciding
    source and the sharing mode beside it (and ``reading``'s time for a local GPU)."""
    budget = card.budget
    return ResolvedDevice(
        source=card.source,
        capacity_bytes=budget.budget_bytes,
        deciding_source=budget.deciding_source,
        sharing_mode=budget.sharing_mode,
        name=card.name,
        uuid=card.uuid,
        cuda_index=card.cuda_index,
        mig_profile=card.mig_profile,
        memory_source=card.memory_source,
        memory_held_by_others_bytes=card.memory_held_by_others_bytes,
        note=card.note,
        warnings=list(card.warnings),
        **reading,
    )
