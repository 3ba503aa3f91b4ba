"""CudaDevice and NVML on a real GPU (`pytest -m gpu`); skipped where torch sees no CUDA."""

from __future__ import annotations

import pytest
import torch

from autobatch.device import Device
from autobatch.device._cuda import CudaDevice
from autobatch.device._nvml import Nvml

pytestmark = pytest.mark.gpu

MiB = 1024**2
GiB = 1024**3
TOLERANCE_BYTES = 256 * MiB
"""Other processes and the driver may move free memory a little between two snapshots."""


@pytest.fixture
def device() -> CudaDevice:
    torch.cuda.empty_cache()
    return CudaDevice(cuda_index=0)


def test_is_a_device_with_a_name_and_driver(device: CudaDevice) -> None:
    assert isinstance(device, Device)
    assert device.type == "cuda"
    assert device.torch_device == torch.device("cuda", 0)
    assert device.name  # NVML's name, e.g. "NVIDIA H200", or torch's
    assert device.driver_version.split(".")[0].isdigit()


def test_nvml_maps_cuda_0_to_torchs_gpu() -> None:
    gpu = Nvml().gpu_for_cuda_index(0)
    torch_uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert gpu.uuid.removeprefix("GPU-").removeprefix("MIG-") == torch_uuid.removeprefix("GPU-")
    free_bytes, total_bytes = torch.cuda.mem_get_info(0)
    assert abs(gpu.memory.free_memory_bytes - free_bytes) < TOLERANCE_BYTES
    assert abs(gpu.memory.total_memory_bytes - total_bytes) < TOLERANCE_BYTES


def test_capacity_starts_from_free_plus_torch_reserved(device: CudaDevice) -> None:
    capacity = device.capacity()
    free_bytes, total_bytes = torch.cuda.mem_get_info(0)

    assert abs(capacity.total_memory_bytes - total_bytes) < TOLERANCE_BYTES
    expected = free_bytes + torch.cuda.memory_reserved(0)
    assert abs(capacity.capacity_bytes - expected) < TOLERANCE_BYTES
    assert capacity.capacity_bytes <= capacity.total_memory_bytes


def test_capacity_does_not_shrink_when_torch_itself_reserves(device: CudaDevice) -> None:
    before = device.capacity().capacity_bytes
    block = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    during = device.capacity().capacity_bytes
    del block
    device.release()

    assert torch.cuda.memory_reserved(0) < GiB
    assert abs(during - before) < TOLERANCE_BYTES  # free fell by 1 GiB, reserved rose by 1 GiB


def test_capacity_honours_the_per_process_fraction(device: CudaDevice) -> None:
    total_bytes = torch.cuda.mem_get_info(0)[1]
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        capacity = device.capacity()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert capacity.capacity_bytes <= int(0.25 * total_bytes)
    assert capacity.capacity_bytes > int(0.25 * total_bytes) - TOLERANCE_BYTES


def test_measure_reports_the_peak_of_the_block(device: CudaDevice) -> None:
    resident = torch.ones(64 * MiB // 4, device="cuda:0")  # 64 MiB float32
    with device.measure([resident]) as peak:
        scratch = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
        del scratch
    assert 320 * MiB <= peak.allocated_bytes < 320 * MiB + 64 * MiB
    assert peak.reserved_bytes >= peak.allocated_bytes
    del resident
    device.release()


def test_measure_fills_the_peak_when_the_block_raises(device: CudaDevice) -> None:
    with pytest.raises(RuntimeError, match="step failed"), device.measure([]) as peak:
        scratch = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda:0")
        raise RuntimeError("step failed")
    del scratch
    assert peak.allocated_bytes >= 128 * MiB
    device.release()


def test_release_returns_the_cache_and_resets_the_peak(device: CudaDevice) -> None:
    block = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
    del block
    assert torch.cuda.memory_reserved(0) >= 512 * MiB  # still cached
    device.release()
    assert torch.cuda.memory_reserved(0) < 512 * MiB
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)


def test_the_budget_names_every_source_and_a_vgpu_limit_decides() -> None:
    # The budget on a real card: NVML and the CUDA runtime agree on an idle card, and a vGPU limit
    # variable (HAMi-core's units) decides below them.
    torch.cuda.empty_cache()
    alone = CudaDevice(cuda_index=0, environ={}).capacity().budget
    limited = CudaDevice(cuda_index=0, environ={"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m"})
    budget = limited.capacity().budget

    assert alone is not None and [r.source for r in alone.readings] == ["nvml", "cuda_runtime"]
    nvml, runtime = alone.readings
    assert abs(nvml.total_bytes - runtime.total_bytes) < TOLERANCE_BYTES
    assert budget is not None and budget.budget_bytes == GiB
    assert (budget.deciding_source, budget.sharing_mode) == ("vgpu_limit", "virtualised")
    declared = CudaDevice(cuda_index=0, gpu_fraction=0.5).capacity()
    assert abs(declared.capacity_bytes - declared.total_memory_bytes // 2) < TOLERANCE_BYTES
