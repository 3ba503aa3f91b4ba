"""A CUDA GPU as a :class:`~autobatch.device.Device`: torch's allocator statistics plus NVML.

Capacity is what this process may still take: the smallest of every source it can see
(:mod:`autobatch.device._budget`), read in this order: NVML's free memory (other processes count)
plus what torch's caching allocator already reserved (:func:`usable_capacity`, a pure function);
the CUDA runtime's ``torch.cuda.mem_get_info`` likewise (a sharing layer such as HAMi makes it
report the container's slice, where NVML may report the whole card); a vGPU limit variable
(``CUDA_DEVICE_MEMORY_LIMIT_<cuda_index>``, else ``CUDA_DEVICE_MEMORY_LIMIT``); an MPS client's
limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, :mod:`autobatch.device._mps`); the allocator's
``torch.cuda.set_per_process_memory_fraction``; a declared ``gpu_fraction`` of the card. The
probe compares peak *reserved* bytes with it, since the allocator's cache and its fragmentation
are what run out.

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
import os
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from autobatch.device._budget import (
    BudgetReading,
    MemoryBudget,
    check_gpu_fraction,
    combine_budget,
    fraction_reading,
    gpu_fraction_reading,
    vgpu_limit_reading,
)
from autobatch.device._mps import mps_limit_reading
from autobatch.device._nvml import Nvml, default_nvml
from autobatch.device._types import Capacity, GpuInfo, PeakMemory
from autobatch.errors import DeviceUnavailableError, Remedy

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


def cuda_budget(
    *,
    nvml_memory: tuple[int, int] | None,
    runtime_memory: tuple[int, int] | None,
    torch_reserved_bytes: int,
    memory_fraction: float,
    gpu_fraction: float | None,
    environ: Mapping[str, str],
    cuda_index: int,
    uuid: str | None = None,
) -> tuple[MemoryBudget, int, int]:
    """The budget of one CUDA device from what its readers returned (pure; torch is read by the
    caller).

    Args:
        nvml_memory: NVML's ``(total, free)`` bytes; None without NVML (or on a unified-memory
            board, where they are the host's).
        runtime_memory: ``torch.cuda.mem_get_info``: ``(free, total)`` bytes; None when it
            failed (then it is an unseen source, with a warning).
        torch_reserved_bytes: ``torch.cuda.memory_reserved``: this process's own cache.
        memory_fraction: ``torch.cuda.get_per_process_memory_fraction``.
        gpu_fraction: the declared share of the card, or None.
        environ: the environment the vGPU and MPS limit variables are read from.
        cuda_index: the device's CUDA index (the ``_<i>`` of the variables).
        uuid: the device's NVML UUID, for an MPS limit given by UUID; None when unknown.

    Returns:
        ``(budget, total_memory_bytes, foreign_memory_bytes)``.

    Raises:
        ConfigError: a vGPU or MPS limit variable that is not a memory limit.
        DeviceUnavailableError: neither NVML nor the CUDA runtime read the memory.
    """
    readings: list[BudgetReading] = []
    if nvml_memory is None and runtime_memory is None:
        raise DeviceUnavailableError(
            f"the memory of CUDA device {cuda_index} can be read neither from NVML nor from the "
            "CUDA runtime (torch.cuda.mem_get_info failed)"
        )
    total_bytes = foreign_bytes = 0
    if nvml_memory is not None:
        own = usable_capacity(
            total_memory_bytes=nvml_memory[0],
            free_memory_bytes=nvml_memory[1],
            torch_reserved_bytes=torch_reserved_bytes,
        )
        total_bytes, foreign_bytes = own.total_memory_bytes, own.foreign_memory_bytes
        readings.append(
            BudgetReading(
                source="nvml",
                total_bytes=total_bytes,
                available_bytes=own.capacity_bytes,
                free_bytes=own.capacity_bytes,
                detail="free memory plus torch's reserved cache",
            )
        )
    runtime_total = total_bytes
    if runtime_memory is not None:
        free_bytes, runtime_total = runtime_memory
        runtime = usable_capacity(
            total_memory_bytes=runtime_total,
            free_memory_bytes=free_bytes,
            torch_reserved_bytes=torch_reserved_bytes,
        )
        if nvml_memory is None:
            total_bytes, foreign_bytes = runtime_total, runtime.foreign_memory_bytes
        readings.append(
            BudgetReading(
                source="cuda_runtime",
                total_bytes=runtime_total,
                available_bytes=runtime.capacity_bytes,
                free_bytes=runtime.capacity_bytes,
                detail="torch.cuda.mem_get_info plus torch's reserved cache",
            )
        )
    limit = vgpu_limit_reading(environ, cuda_index)
    if limit is not None:
        readings.append(limit)
    mps = mps_limit_reading(environ, cuda_index=cuda_index, uuid=uuid)
    if mps is not None:
        readings.append(mps)
    if memory_fraction < 1.0:
        readings.append(
            fraction_reading(
                "memory_fraction",
                memory_fraction,
                runtime_total,
                f"torch.cuda.set_per_process_memory_fraction({memory_fraction})",
            )
        )
    if gpu_fraction is not None:
        readings.append(gpu_fraction_reading(gpu_fraction, total_bytes))
    unseen = ("cuda_runtime",) if runtime_memory is None else ()
    return combine_budget(readings, unseen_sources=unseen), total_bytes, foreign_bytes


class CudaDevice:
    """``torch.device("cuda", cuda_index)`` as a :class:`~autobatch.device.Device`.

    Args:
        cuda_index: torch's index (under ``CUDA_VISIBLE_DEVICES``).
        nvml: the NVML to query; None is :func:`~autobatch.device._nvml.default_nvml`. Without
            NVML (no libnvidia-ml in the container) capacity comes from
            ``torch.cuda.mem_get_info`` and ``driver_version`` is ``""``.
        gpu_fraction: the share of the card this job is declared to get (0 < x <= 1), e.g. 0.5
            for Ray's ``num_gpus=0.5``: ``gpu_fraction`` times the card's total memory joins the
            sources. Declared, not enforced: the probe counts a step past it as over capacity.
        environ: where the vGPU limit variables are read; None is ``os.environ`` (read at each
            :meth:`capacity`).

    Raises:
        DeviceUnavailableError: torch has no CUDA (CPU build, no driver) or no such index.
        ConfigError: ``gpu_fraction`` is not in (0, 1].
    """

    def __init__(
        self,
        cuda_index: int = 0,
        *,
        nvml: Nvml | None = None,
        gpu_fraction: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._gpu_fraction = check_gpu_fraction(gpu_fraction)
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"CUDA is not available to torch {torch.__version__} (built for CUDA "
                f"{torch.version.cuda or 'none: a CPU-only build'})",
                remedies=[
                    Remedy(parameter="device", values=("cpu", "sim:SIZE")),
                    Remedy(purpose="a CUDA build of torch on a machine with a GPU"),
                ],
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
        self._environ = environ

    def with_gpu_fraction(self, gpu_fraction: float | None) -> CudaDevice:
        """This card (same index, NVML and environment) with ``gpu_fraction`` declared."""
        return CudaDevice(
            self._cuda_index, nvml=self._nvml, gpu_fraction=gpu_fraction, environ=self._environ
        )

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

    def _budget(self) -> tuple[MemoryBudget, int, int]:
        """Every source read now (module docstring), combined; with the card's total memory
        (NVML's, a MIG slice's own; the CUDA runtime's without NVML) and the bytes held by
        others."""
        gpu = self._gpu()
        memory = None if gpu is None else gpu.memory
        nvml_memory = None
        if (
            memory is not None
            and memory.total_memory_bytes is not None
            and memory.free_memory_bytes is not None
            and not memory.unified_memory  # the host's numbers: the CUDA runtime's instead
        ):
            nvml_memory = (memory.total_memory_bytes, memory.free_memory_bytes)
        index = self._cuda_index
        try:
            runtime_memory: tuple[int, int] | None = torch.cuda.mem_get_info(index)
        except (RuntimeError, AssertionError):  # no context can be made here: NVML's alone
            runtime_memory = None
        return cuda_budget(
            nvml_memory=nvml_memory,
            runtime_memory=runtime_memory,
            torch_reserved_bytes=torch.cuda.memory_reserved(index),
            memory_fraction=torch.cuda.get_per_process_memory_fraction(index),
            gpu_fraction=self._gpu_fraction,
            environ=os.environ if self._environ is None else self._environ,
            cuda_index=index,
            uuid=None if gpu is None else gpu.uuid,
        )

    def capacity(self) -> Capacity:
        """See the module docstring; a MIG instance reports its own slice."""
        budget, total_bytes, foreign_bytes = self._budget()
        return Capacity(
            total_memory_bytes=total_bytes,
            capacity_bytes=min(budget.budget_bytes, total_bytes),
            foreign_memory_bytes=foreign_bytes,
            budget=budget,
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

    def clock(self) -> float:
        return time.perf_counter()

    @property
    def steps_scale_with_size(self) -> bool:
        return False  # small steps are bound by kernel launches, not by the size

    def __repr__(self) -> str:
        return f"CudaDevice(cuda_index={self._cuda_index})"
