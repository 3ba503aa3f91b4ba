"""NVML, the NVIDIA driver's management library: the only module that imports ``pynvml``.

``pynvml`` comes from the ``nvidia-ml-py`` distribution (never the deprecated ``pynvml`` package).
NVML is initialised lazily, once per :class:`Nvml` instance (thread-safe), on the first query, so
``import autobatch`` works on machines without a driver. It is never shut down: the handle lives as
long as the process, like nvitop's. Every ``NVMLError_*``, and the ``ImportError``/``OSError`` of a
missing library, becomes :class:`~autobatch.errors.DeviceUnavailableError` with a stable
``reason`` code (:data:`REASONS`) in one place,
:func:`autobatch.device._nvml_errors.translate`.

The device set is what this process was given (``NVIDIA_VISIBLE_DEVICES``, then
``CUDA_VISIBLE_DEVICES``, ordered by ``CUDA_DEVICE_ORDER``), resolved in one place,
:func:`autobatch.device._visible.resolve_visible`. ``nvml_index`` is NVML's PCI-order number;
``cuda_index`` is CUDA's number inside the given set, None outside it. Cards NVML sees but the
container was not given (a privileged pod) are listed with ``given=False``, never planned on.

One unreadable GPU never hides the others: a GPU whose memory NVML cannot read (NotSupported on
unified-memory boards, NoPermission on a MIG parent) is listed with memory from the CUDA runtime,
the host (unified memory), or unknown, and the reason.

Example::

    nvml = default_nvml()
    for gpu in nvml.list_gpus():
        print(gpu.cuda_index, gpu.name, gpu.memory.free_memory_bytes, gpu.memory.memory_source)
    nvml.gpu_for_cuda_index(0).memory.total_memory_bytes    # 85899345920 on an 80 GiB card
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autobatch.device._nvml_errors import (
    NOT_SUPPORTED_ERRORS,
    REASONS,
    error_classes,
    is_stub,
    loaded_library_paths,
    nvml_errors,
    reason_of,
    translate,
)
from autobatch.device._types import UNKNOWN_MEMORY, GpuInfo, MemoryInfo, MemorySource
from autobatch.device._visible import (
    CUDA_VISIBLE_VAR,
    NVIDIA_VISIBLE_VAR,
    NvmlDevice,
    VisibleDevices,
    fastest_first,
    resolve_visible,
)
from autobatch.errors import DeviceUnavailableError

__all__ = [
    "REASONS",
    "Nvml",
    "default_nvml",
    "list_gpus",
]


_NO_V2_MEMORY_ERRORS = (*NOT_SUPPORTED_ERRORS, "NVMLError_ArgumentVersionMismatch")
_UNREADABLE_MEMORY_ERRORS = (*NOT_SUPPORTED_ERRORS, "NVMLError_NoPermission")
_EMPTY_MIG_SLOT_ERRORS = ("NVMLError_NotFound", "NVMLError_InvalidArgument")
_UNIFIED_ADDRESSING_MODE = "NVML_DEVICE_ADDRESSING_MODE_ATS"
_MIG_PROFILE = re.compile(r"\bMIG (\d+g\.\d+gb)\b", re.IGNORECASE)

TorchMemGetInfo = Callable[[str], "tuple[int, int] | None"]
"""``uuid -> (free_bytes, total_bytes)`` from ``torch.cuda.mem_get_info``, or None when torch
cannot see that device."""
HostMemory = Callable[[], "tuple[int, int] | None"]
"""``() -> (available_bytes, total_bytes)`` of the host, or None when unknown."""


def _import_pynvml() -> Any:
    import pynvml  # the nvidia-ml-py distribution

    return pynvml


def _strip_uuid_prefix(uuid: str) -> str:
    for prefix in ("GPU-", "MIG-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix) :]
    return uuid


def _torch_mem_get_info(uuid: str) -> tuple[int, int] | None:
    """``torch.cuda.mem_get_info`` of the device torch knows by ``uuid`` (it creates a CUDA
    context there, so it is asked only when NVML cannot answer)."""
    import torch

    if not torch.cuda.is_available():
        return None
    wanted = _strip_uuid_prefix(uuid)
    for cuda_index in range(torch.cuda.device_count()):
        if _strip_uuid_prefix(str(torch.cuda.get_device_properties(cuda_index).uuid)) == wanted:
            free_bytes, total_bytes = torch.cuda.mem_get_info(cuda_index)
            return int(free_bytes), int(total_bytes)
    return None


def _host_memory() -> tuple[int, int] | None:
    """``(MemAvailable, MemTotal)`` from ``/proc/meminfo``, in bytes."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[key] = int(fields[0]) * 1024  # kB
    except OSError:
        return None
    if "MemAvailable" not in values or "MemTotal" not in values:
        return None
    return values["MemAvailable"], values["MemTotal"]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Nvml:
    """NVML queries, with lazy one-time initialisation and translated errors.

    Args:
        module: the pynvml module to use; None imports ``pynvml`` on first use. Tests pass a fake.
        environ: where ``NVIDIA_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES`` and
            ``CUDA_DEVICE_ORDER`` are read; None reads ``os.environ`` at each query.
        torch_mem_get_info: the fallback when NVML does not report a GPU's memory; None uses
            ``torch.cuda.mem_get_info`` for devices torch can see.
        host_memory: the host's (available, total) bytes, for unified-memory GPUs; None reads
            ``/proc/meminfo``.
        loaded_libraries: paths of the loaded shared objects, to tell the CUDA toolkit's stub
            libnvidia-ml from the driver's; None reads ``/proc/self/maps``.

    A failed initialisation is not remembered: the next query tries again.
    """

    def __init__(
        self,
        module: Any = None,
        *,
        environ: Mapping[str, str] | None = None,
        torch_mem_get_info: TorchMemGetInfo | None = None,
        host_memory: HostMemory | None = None,
        loaded_libraries: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._module = module
        self._environ = environ
        self._torch_mem_get_info = torch_mem_get_info or _torch_mem_get_info
        self._host_memory = host_memory or _host_memory
        self._loaded_libraries = loaded_libraries or loaded_library_paths
        self._lib: Any = None
        self._init_lock = threading.Lock()

    def _stub_path(self) -> str:
        return next((p for p in self._loaded_libraries() if is_stub(p)), "")

    def _library(self) -> Any:
        """The initialised pynvml module."""
        lib = self._lib
        if lib is not None:
            return lib
        with self._init_lock:
            if self._lib is None:
                module = self._module
                if module is None:
                    with nvml_errors(None, "import pynvml"):
                        module = _import_pynvml()
                try:
                    module.nvmlInit()
                except Exception as exc:
                    translated = translate(module, "initialise", exc, stub_path=self._stub_path())
                    if translated is None:
                        raise
                    raise translated from exc
                self._lib = module
            return self._lib

    @property
    def environ(self) -> Mapping[str, str]:
        """Where the visible-device variables are read."""
        return os.environ if self._environ is None else self._environ

    def _scan(self, lib: Any) -> list[NvmlDevice]:
        devices: list[NvmlDevice] = []
        for nvml_index in range(lib.nvmlDeviceGetCount()):
            handle = lib.nvmlDeviceGetHandleByIndex(nvml_index)
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
            try:
                current_mode, _pending_mode = lib.nvmlDeviceGetMigMode(handle)
                mig_enabled = current_mode == lib.NVML_DEVICE_MIG_ENABLE
            except error_classes(lib, _UNREADABLE_MEMORY_ERRORS):
                mig_enabled = False
            name = _text(lib.nvmlDeviceGetName(handle))
            devices.append(
                NvmlDevice(
                    nvml_index=nvml_index,
                    uuid=uuid,
                    name=name,
                    handle=handle,
                    mig_enabled=mig_enabled,
                )
            )
            if mig_enabled:
                devices.extend(_mig_devices(lib, nvml_index, handle, uuid))
        return devices

    def _speed(self, lib: Any, devices: Sequence[NvmlDevice]) -> dict[str, float]:
        """CUDA cores x max SM clock of each physical GPU NVML reports them for."""
        unsupported = error_classes(lib, (*_UNREADABLE_MEMORY_ERRORS, "NVMLLibraryMismatchError"))
        speed: dict[str, float] = {}
        for device in devices:
            if device.is_mig:
                continue
            try:
                cores = lib.nvmlDeviceGetNumGpuCores(device.handle)
                clock_mhz = lib.nvmlDeviceGetMaxClockInfo(device.handle, lib.NVML_CLOCK_SM)
            except unsupported:
                continue
            speed[device.uuid] = float(cores) * float(clock_mhz)
        return speed

    def visible(self) -> tuple[list[NvmlDevice], VisibleDevices]:
        """Every NVML device with its ``cuda_index`` and ``given`` set, and the resolved set.

        No memory is read: this is the listing the service caches, apart from the readings.

        Returns:
            The devices in NVML order (each GPU in MIG mode followed by its instances) and the
            :class:`~autobatch.device._visible.VisibleDevices` they were resolved with.

        Raises:
            DeviceUnavailableError: no driver or libnvidia-ml, or the listing failed.
        """
        lib = self._library()
        with nvml_errors(lib, "list GPUs"):
            devices = self._scan(lib)
            environ, mounted_note = _with_mounted_device_list(self.environ)
            physical_names = {device.name for device in devices if not device.is_mig}
            needs_speed = fastest_first(environ) and len(physical_names) > 1
            speed = self._speed(lib, devices) if needs_speed else None
        resolved = resolve_visible(devices, environ, speed=speed)
        if mounted_note:  # no device: say which path gave none, not that the list was ''
            resolved = dataclasses.replace(resolved, note=mounted_note)
        cuda_indices = {uuid: i for i, uuid in enumerate(resolved.cuda_order)}
        return [
            dataclasses.replace(
                device,
                cuda_index=cuda_indices.get(device.uuid),
                given=device.uuid in resolved.given,
            )
            for device in devices
        ], resolved

    def devices(self) -> list[NvmlDevice]:
        """:meth:`visible`'s devices."""
        return self.visible()[0]

    def read(self, device: NvmlDevice) -> GpuInfo:
        """``device`` with its memory, read now.

        NVML first (v2, else v1); when NVML cannot read it (NotSupported, NoPermission, a total
        of 0), the CUDA runtime's ``mem_get_info`` when torch sees the device, else the host's
        available memory for a unified-memory GPU, else unknown; ``memory_reason`` says why.

        Raises:
            DeviceUnavailableError: the query failed otherwise; ``reason`` is ``gpu_lost`` for a
                GPU that fell off the bus.
        """
        lib = self._library()
        with nvml_errors(lib, f"read the memory of GPU {device.uuid}"):
            memory, reason, detail = self._memory(lib, device)
        return device.info(memory, reason=reason, detail=detail)

    def _memory(self, lib: Any, device: NvmlDevice) -> tuple[MemoryInfo, str, str]:
        try:
            memory = _nvml_memory(lib, device.handle)
        except error_classes(lib, _UNREADABLE_MEMORY_ERRORS) as exc:
            reason = reason_of(lib, exc)
            detail = f"NVML could not read the memory of GPU {device.uuid}: {exc}"
        else:
            if memory.total_memory_bytes:
                return memory, "", ""
            reason = "zero_total"
            detail = f"NVML reported a total of 0 bytes for GPU {device.uuid}"
        fallback = self._torch_mem_get_info(device.uuid) if device.cuda_index is not None else None
        if fallback is not None:
            memory = _free_of_total(*fallback, memory_source="cuda_runtime")
            return memory, reason, detail + "; memory from torch.cuda.mem_get_info"
        if not device.is_mig and _unified(lib, device.handle):
            host = self._host_memory()
            if host is not None:
                memory = _free_of_total(*host, memory_source="host", unified_memory=True)
                return memory, reason, detail + "; unified memory: the host's available memory"
        return UNKNOWN_MEMORY, reason, detail + "; memory unknown"

    def list_gpus(self) -> list[GpuInfo]:
        """Every GPU NVML sees, in NVML order, each GPU in MIG mode followed by its instances.

        Returns:
            One :class:`GpuInfo` per physical GPU and per MIG instance (a MIG instance carries
            its own memory, profile and ``parent_uuid``; a GPU in MIG mode has ``cuda_index``
            None, since CUDA sees its instances instead). A GPU whose memory cannot be read
            (even one lost) is listed with ``memory_reason`` set; it never hides the others.

        Raises:
            DeviceUnavailableError: no driver or libnvidia-ml, or the listing itself failed.
        """
        gpus: list[GpuInfo] = []
        for device in self.devices():
            try:
                gpus.append(self.read(device))
            except DeviceUnavailableError as exc:
                gpus.append(device.info(UNKNOWN_MEMORY, reason=exc.reason, detail=str(exc)))
        return gpus

    def gpu_for_cuda_index(self, cuda_index: int) -> GpuInfo:
        """The GPU CUDA calls ``cuda:cuda_index`` in this process's device set.

        Raises:
            DeviceUnavailableError: that index is not in the set (the message gives the visible
                count and the variables), or NVML is unavailable.
        """
        devices = self.devices()
        for device in devices:
            if device.cuda_index == cuda_index:
                return self.read(device)
        num_visible = sum(device.cuda_index is not None for device in devices)
        environ = self.environ
        raise DeviceUnavailableError(
            f"CUDA device {cuda_index} is not visible: this process sees {num_visible} CUDA "
            f"device(s) ({CUDA_VISIBLE_VAR}={environ.get(CUDA_VISIBLE_VAR)!r}, "
            f"{NVIDIA_VISIBLE_VAR}={environ.get(NVIDIA_VISIBLE_VAR)!r}).",
            reason="not_visible",
        )

    def gpu_for_uuid(self, uuid: str) -> GpuInfo:
        """The GPU or MIG instance with this UUID, with or without its ``GPU-``/``MIG-`` prefix.

        Raises:
            DeviceUnavailableError: no such device, or NVML is unavailable.
        """
        wanted = _strip_uuid_prefix(uuid)
        for device in self.devices():
            if _strip_uuid_prefix(device.uuid) == wanted:
                return self.read(device)
        raise DeviceUnavailableError(f"NVML lists no GPU with UUID {uuid!r}.", reason="not_found")

    def driver_version(self) -> str:
        """The NVIDIA driver's version, e.g. ``"550.54.15"``.

        Raises:
            DeviceUnavailableError: no driver or libnvidia-ml.
        """
        lib = self._library()
        with nvml_errors(lib, "read the driver version"):
            return _text(lib.nvmlSystemGetDriverVersion())


def _with_mounted_device_list(environ: Mapping[str, str]) -> tuple[Mapping[str, str], str]:
    """``environ`` with a ``NVIDIA_VISIBLE_DEVICES`` path read as the device list it names, and
    a note naming the path when it gives no device ("" otherwise).

    The NVIDIA device plugin's ``volume-mounts`` strategy sets the variable to a directory
    (``/var/run/nvidia-container-devices``) holding one entry per given device; a missing
    directory gives an empty list (no device).
    """
    spec = environ.get(NVIDIA_VISIBLE_VAR, "")
    if not spec.startswith("/"):
        return environ, ""
    where = f"{NVIDIA_VISIBLE_VAR}={spec!r} (the device plugin's volume-mounts directory)"
    try:
        names = sorted(os.listdir(spec))
    except OSError as exc:
        names = []
        note = (
            f"{where} cannot be read ({exc.strerror or exc}): this container was given no GPU; "
            "check that the device plugin mounts it into the pod"
        )
    else:
        note = "" if names else f"{where} lists no device: this container was given no GPU"
    return {**environ, NVIDIA_VISIBLE_VAR: ",".join(names) or "none"}, note


def _mig_devices(lib: Any, nvml_index: int, handle: Any, uuid: str) -> list[NvmlDevice]:
    found: list[NvmlDevice] = []
    for slot in range(lib.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig_handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except error_classes(lib, _EMPTY_MIG_SLOT_ERRORS):
            continue  # no instance in this slot
        name = _text(lib.nvmlDeviceGetName(mig_handle))
        match = _MIG_PROFILE.search(name)
        found.append(
            NvmlDevice(
                nvml_index=nvml_index,
                uuid=_text(lib.nvmlDeviceGetUUID(mig_handle)),
                name=name,
                handle=mig_handle,
                is_mig=True,
                parent_uuid=uuid,
                mig_slot=slot,
                mig_profile=match.group(1).lower() if match else "",
            )
        )
    return found


def _unified(lib: Any, handle: Any) -> bool:
    """Whether the GPU addresses host memory as its own (ATS; e.g. GB10); False when unknown."""
    ats = getattr(lib, _UNIFIED_ADDRESSING_MODE, None)
    function = getattr(lib, "nvmlDeviceGetAddressingMode", None)
    if ats is None or function is None:
        return False
    try:
        return bool(function(handle) == ats)
    except error_classes(lib, (*_UNREADABLE_MEMORY_ERRORS, "NVMLLibraryMismatchError")):
        return False


def _free_of_total(
    free_bytes: int, total_bytes: int, *, memory_source: MemorySource, unified_memory: bool = False
) -> MemoryInfo:
    """A reading from a fallback that gives (free, total) bytes and counts everything not free
    as used, the driver's reserve included."""
    return MemoryInfo(
        total_memory_bytes=total_bytes,
        free_memory_bytes=free_bytes,
        used_memory_bytes=total_bytes - free_bytes,
        used_includes_reserved=True,
        memory_source=memory_source,
        unified_memory=unified_memory,
    )


def _nvml_memory(lib: Any, handle: Any) -> MemoryInfo:
    """nvmlDeviceGetMemoryInfo v2 (``used`` without the driver's reserve), else v1."""
    version = getattr(lib, "nvmlMemory_v2", None)
    if version is not None:
        try:
            memory = lib.nvmlDeviceGetMemoryInfo(handle, version=version)
        except error_classes(lib, _NO_V2_MEMORY_ERRORS):
            pass
        else:
            return MemoryInfo(
                total_memory_bytes=int(memory.total),
                free_memory_bytes=int(memory.free),
                used_memory_bytes=int(memory.used),
                reserved_memory_bytes=int(memory.reserved),
            )
    memory = lib.nvmlDeviceGetMemoryInfo(handle)
    return MemoryInfo(
        total_memory_bytes=int(memory.total),
        free_memory_bytes=int(memory.free),
        used_memory_bytes=int(memory.used),
        used_includes_reserved=True,
    )


_default_lock = threading.Lock()
_default_nvml: Nvml | None = None


def default_nvml() -> Nvml:
    """The process-wide :class:`Nvml` over the real ``pynvml`` (created, not initialised, here)."""
    global _default_nvml
    with _default_lock:
        if _default_nvml is None:
            _default_nvml = Nvml()
        return _default_nvml


def list_gpus() -> list[GpuInfo]:
    """:meth:`Nvml.list_gpus` on :func:`default_nvml`; what ``autobatch devices`` prints."""
    return default_nvml().list_gpus()
