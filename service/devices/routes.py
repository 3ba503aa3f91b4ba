"""``GET /v1/devices``: this node's GPUs from NVML, or an empty list with the reason."""

from __future__ import annotations

from fastapi import APIRouter

from autobatch.errors import DeviceUnavailableError
from service.deps import StateDep
from service.devices.gpus import Reading
from service.web.problems import problem_responses
from service.web.routing import JsonBodyRoute
from service.web.schemas import DeviceList, GpuPublic
from service.web.wording import describe

router = APIRouter(
    prefix="/v1/devices",
    route_class=JsonBodyRoute,
    tags=["devices"],
    responses=problem_responses(401),
)


def gpu_public(reading: Reading) -> GpuPublic:
    gpu, memory = reading.gpu, reading.gpu.memory
    return GpuPublic(
        nvml_index=gpu.nvml_index,
        cuda_index=gpu.cuda_index,
        uuid=gpu.uuid,
        name=gpu.name,
        total_memory_bytes=memory.total_memory_bytes,
        free_memory_bytes=memory.free_memory_bytes,
        used_memory_bytes=memory.used_memory_bytes,
        reserved_memory_bytes=memory.reserved_memory_bytes,
        used_includes_reserved=memory.used_includes_reserved,
        memory_source=memory.memory_source,
        unified_memory=memory.unified_memory,
        is_mig=gpu.is_mig,
        parent_uuid=gpu.parent_uuid,
        mig_profile=gpu.mig_profile,
        given=gpu.given,
        memory_reason=gpu.memory_reason or None,
        memory_detail=gpu.memory_detail or None,
        sampled_at=reading.sampled_at,
        age_seconds=round(reading.age_seconds(), 3),
    )


@router.get("", summary="List this node's GPUs (NVML)")
async def list_devices(state: StateDep) -> DeviceList:
    """Every GPU and MIG instance NVML sees, with memory in bytes (null where unknown) and where
    it came from. ``given`` marks the cards this container was given; the others (a privileged
    pod) are listed but never planned on, and ``note`` says so. Without NVML the list is empty,
    ``reason`` a stable code and ``detail`` the cause and fix."""
    try:
        inventory, readings = await state.gpus.snapshot()
    except DeviceUnavailableError as exc:
        return DeviceList(devices=[], reason=exc.reason, detail=describe(exc))
    return DeviceList(
        devices=[gpu_public(reading) for reading in readings],
        note=inventory.visible.note or None,
    )
