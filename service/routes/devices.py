"""``GET /v1/devices``: this node's GPUs from NVML, or an empty list with the reason."""

from __future__ import annotations

from fastapi import APIRouter

from autobatch.device import GpuInfo
from autobatch.errors import DeviceUnavailableError
from service.deps import StateDep
from service.problems import problem_responses
from service.routing import JsonBodyRoute
from service.schemas import DeviceList, GpuPublic

router = APIRouter(
    prefix="/v1/devices",
    route_class=JsonBodyRoute,
    tags=["devices"],
    responses=problem_responses(401),
)


def gpu_public(gpu: GpuInfo) -> GpuPublic:
    return GpuPublic(
        nvml_index=gpu.nvml_index,
        cuda_index=gpu.cuda_index,
        uuid=gpu.uuid,
        name=gpu.name,
        total_memory_bytes=gpu.memory.total_memory_bytes,
        free_memory_bytes=gpu.memory.free_memory_bytes,
        used_memory_bytes=gpu.memory.used_memory_bytes,
        reserved_memory_bytes=gpu.memory.reserved_memory_bytes,
        is_mig=gpu.is_mig,
        parent_uuid=gpu.parent_uuid,
    )


@router.get("", summary="List this node's GPUs (NVML)")
def list_devices(state: StateDep) -> DeviceList:
    """Every GPU and MIG instance NVML sees, with memory in bytes; ``reason`` says why the list
    is empty when there is no NVML (no driver, or a container without the library)."""
    try:
        gpus = state.list_gpus()
    except DeviceUnavailableError as exc:
        return DeviceList(devices=[], reason=str(exc))
    return DeviceList(devices=[gpu_public(gpu) for gpu in gpus])
