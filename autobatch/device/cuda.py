"""A CUDA GPU as a :class:`~autobatch.device.Device`: torch's allocator statistics plus NVML.

Capacity is what this process may still take: the driver's free memory (other processes count)
plus what torch's caching allocator already reserved, capped by
``torch.cuda.set_per_process_memory_fraction``. The arithmetic is :func:`usable_capacity`, a pure
function. The probe compares peak *reserved* bytes with it, since the allocator's cache and its
fragmentation are what run out.

Example::

    device = CudaDevice(cuda_index=0)
    device.capacity().capacity_bytes      # e.g. 53687091200 with 30 GiB of 80 GiB taken elsewhere
    with device.measure(resident=[]) as peak:
        run_step()
    peak.reserved_bytes
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

import torch

from autobatch.device.nvml import Nvml, default_nvml
from autobatch.device.types import Capacity, GpuInfo, PeakMemory
from autobatch.errors import DeviceUnavailableError

__all__ = ["CudaDevice", "usable_capacity"]


def usable_capacity(
    *,
    total_memory_bytes: int,
    free_memory_bytes: int,
    torch_reserved_bytes: int,
    memory_fraction: float = 1.0,
) -> Capacity:
    """The bytes this process may still take on a GPU, from one snapshot of its memory.

    Args:
        total_memory_bytes: the device's (or MIG slice's) total memory.
        free_memory_bytes: the driver's free memory (NVML's ``free``, never total minus used).
        torch_reserved_bytes: ``torch.cuda.memory_reserved``: held by this process's allocator,
            so reusable by it although the driver counts it as used.
        memory_fraction: ``torch.cuda.get_per_process_memory_fraction``; below 1 the allocator
            refuses to reserve more than this share of the total.

    Returns:
        ``capacity_bytes = min(free + reserved, fraction * total)`` (clamped to [0, total]) and
        ``foreign_memory_bytes = total - free - reserved`` (clamped >= 0): other processes, the
        driver's reserve and this process's own CUDA context, which torch does not count.
    """
    capacity_bytes = free_memory_bytes + torch_reserved_bytes
    if memory_fraction < 1.0:
        capacity_bytes = min(capacity_bytes, int(memory_fraction * total_memory_bytes))
    return Capacity(
        total_memory_bytes=total_memory_bytes,
        capacity_bytes=max(0, min(capacity_bytes, total_memory_bytes)),
        foreign_memory_bytes=max(0, total_memory_bytes - free_memory_bytes - torch_reserved_bytes),
    )


class CudaDevice:
    """``torch.device("cuda", cuda_index)`` as a :class:`~autobatch.device.Device`.

    Args:
        cuda_index: torch's index (under ``CUDA_VISIBLE_DEVICES``).
        nvml: the NVML to query; None is :func:`~autobatch.device.nvml.default_nvml`. Without
            NVML (no libnvidia-ml in the container) capacity comes from
            ``torch.cuda.mem_get_info`` and ``driver_version`` is ``""``.

    Raises:
        DeviceUnavailableError: torch has no CUDA (CPU build, no driver) or no such index.
    """

    def __init__(self, cuda_index: int = 0, *, nvml: Nvml | None = None) -> None:
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"CUDA is not available to torch {torch.__version__} (built for CUDA "
                f"{torch.version.cuda or 'none: a CPU-only build'}); use --device cpu or "
                "--device sim:SIZE, or install a CUDA build of torch on a machine with a GPU."
            )
        num_devices = torch.cuda.device_count()
        if not 0 <= cuda_index < num_devices:
            raise DeviceUnavailableError(
                f"CUDA device {cuda_index} does not exist: torch sees {num_devices} device(s) "
                f"(cuda:0 to cuda:{num_devices - 1})."
            )
        self._cuda_index = cuda_index
        self._torch_device = torch.device("cuda", cuda_index)
        self._nvml = default_nvml() if nvml is None else nvml
        self._uuid: str | None = None
        self._name: str | None = None

    def _gpu(self) -> GpuInfo | None:
        """This device as NVML sees it now; None when NVML is unavailable or does not know it."""
        try:
            if self._uuid is not None:
                return self._nvml.gpu_for_uuid(self._uuid)
            torch_uuid = str(torch.cuda.get_device_properties(self._cuda_index).uuid)
            try:
                gpu = self._nvml.gpu_for_uuid(torch_uuid)
            except DeviceUnavailableError:
                gpu = self._nvml.gpu_for_cuda_index(self._cuda_index)
        except DeviceUnavailableError:
            return None
        self._uuid = gpu.uuid
        return gpu

    @property
    def name(self) -> str:
        if self._name is None:
            gpu = self._gpu()
            self._name = gpu.name if gpu else torch.cuda.get_device_name(self._cuda_index)
        return self._name

    @property
    def type(self) -> str:
        return "cuda"

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    @property
    def driver_version(self) -> str:
        try:
            return self._nvml.driver_version()
        except DeviceUnavailableError:
            return ""

    def capacity(self) -> Capacity:
        """See :func:`usable_capacity`; a MIG instance reports its own slice."""
        gpu = self._gpu()
        memory = None if gpu is None else gpu.memory
        if (
            memory is not None
            and memory.total_memory_bytes is not None
            and memory.free_memory_bytes is not None
            and not memory.unified_memory  # the host's numbers: ask the CUDA runtime instead
        ):
            total_bytes, free_bytes = memory.total_memory_bytes, memory.free_memory_bytes
        else:
            free_bytes, total_bytes = torch.cuda.mem_get_info(self._cuda_index)
        return usable_capacity(
            total_memory_bytes=total_bytes,
            free_memory_bytes=free_bytes,
            torch_reserved_bytes=torch.cuda.memory_reserved(self._cuda_index),
            memory_fraction=torch.cuda.get_per_process_memory_fraction(self._cuda_index),
        )

    @contextlib.contextmanager
    def measure(self, resident: Sequence[torch.Tensor]) -> Iterator[PeakMemory]:
        """Peak allocated and reserved bytes of the block (``resident`` is already counted by
        the allocator's statistics, so it is ignored); filled on exit, also on an exception."""
        torch.cuda.synchronize(self._torch_device)
        torch.cuda.reset_peak_memory_stats(self._torch_device)
        peak = PeakMemory()
        try:
            yield peak
        finally:
            peak.allocated_bytes = torch.cuda.max_memory_allocated(self._torch_device)
            peak.reserved_bytes = torch.cuda.max_memory_reserved(self._torch_device)

    def release(self) -> None:
        gc.collect()  # first: tensors held by reference cycles (an OOM's traceback) go back
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self._torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._torch_device)

    def __repr__(self) -> str:
        return f"CudaDevice(cuda_index={self._cuda_index})"
