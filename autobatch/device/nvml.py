"""NVML, the NVIDIA driver's management library: the only module that imports ``pynvml``.

``pynvml`` comes from the ``nvidia-ml-py`` distribution (never the deprecated ``pynvml`` package).
NVML is initialised lazily, once per :class:`Nvml` instance (thread-safe), on the first query, so
``import autobatch`` works on machines without a driver. It is never shut down: the handle lives as
long as the process, like nvitop's. Every ``NVMLError_*``, and the ``ImportError``/``OSError`` of a
missing library, becomes :class:`~autobatch.errors.DeviceUnavailableError` in one place,
:func:`_translate`.

CUDA and NVML number GPUs differently: NVML in PCI order over the whole machine, CUDA over what
``CUDA_VISIBLE_DEVICES`` lets the process see, in the order it lists them, by index or by (a
unique prefix of) a ``GPU-...``/``MIG-...`` UUID. :meth:`Nvml.list_gpus` resolves that variable
the way the CUDA driver does and gives each GPU its ``cuda_index`` (None when not visible).

Example::

    nvml = default_nvml()
    for gpu in nvml.list_gpus():
        print(gpu.cuda_index, gpu.name, gpu.memory.free_memory_bytes)
    nvml.gpu_for_cuda_index(0).memory.total_memory_bytes    # 85899345920 on an 80 GiB card
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from autobatch.device import GpuInfo, MemoryInfo
from autobatch.errors import DeviceUnavailableError

__all__ = [
    "Nvml",
    "default_nvml",
    "driver_version",
    "gpu_for_cuda_index",
    "list_gpus",
]

_VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

_MISSING_LIBRARY_ERRORS = (
    "NVMLError_LibraryNotFound",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
    "NVMLError_Uninitialized",
)
"""NVML errors that mean "there is no usable driver", not "this query failed"."""

_NOT_SUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
_NO_V2_MEMORY_ERRORS = (*_NOT_SUPPORTED_ERRORS, "NVMLError_ArgumentVersionMismatch")
_EMPTY_MIG_SLOT_ERRORS = ("NVMLError_NotFound", "NVMLError_InvalidArgument")

TorchMemGetInfo = Callable[[int], "tuple[int, int] | None"]
"""``cuda_index -> (free_bytes, total_bytes)``, or None when torch cannot see that device."""


def _import_pynvml() -> Any:
    import pynvml  # the nvidia-ml-py distribution

    return pynvml


def _torch_mem_get_info(cuda_index: int) -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available() or not 0 <= cuda_index < torch.cuda.device_count():
        return None
    free_bytes, total_bytes = torch.cuda.mem_get_info(cuda_index)
    return int(free_bytes), int(total_bytes)


def _error_classes(lib: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The named exception classes of ``lib`` (older bindings may lack some)."""
    found = (getattr(lib, name, None) for name in names)
    return tuple(cls for cls in found if isinstance(cls, type))


def _unavailable_message(exc: BaseException) -> str:
    return (
        f"NVML is not available: no NVIDIA driver or libnvidia-ml found ({exc}). "
        "autobatch can still probe the CPU or a simulated device (--device sim:SIZE)."
    )


def _translate(lib: Any, action: str, exc: BaseException) -> DeviceUnavailableError | None:
    """The :class:`DeviceUnavailableError` for one of NVML's exceptions; None for any other.

    The only place NVML's exceptions are translated; :func:`_nvml_errors` applies it to a block.

    Args:
        lib: the pynvml module (None before it is imported).
        action: what was being done, for the message, e.g. ``"list GPUs"``.
        exc: what was raised. ``ImportError``/``OSError`` (no library), every ``NVMLError_*``
            and pynvml's ``NVMLLibraryMismatchError`` are translated.
    """
    if isinstance(exc, (ImportError, OSError)):
        return DeviceUnavailableError(_unavailable_message(exc))
    if not isinstance(exc, _error_classes(lib, ("NVMLError", "NVMLLibraryMismatchError"))):
        return None
    if isinstance(exc, _error_classes(lib, _MISSING_LIBRARY_ERRORS)):
        return DeviceUnavailableError(_unavailable_message(exc))
    return DeviceUnavailableError(f"NVML could not {action}: {exc} ({type(exc).__name__}).")


@contextlib.contextmanager
def _nvml_errors(lib: Any, action: str) -> Iterator[None]:
    """Raise :func:`_translate`'s error ``from`` NVML's; other exceptions propagate unchanged."""
    try:
        yield
    except Exception as exc:
        translated = _translate(lib, action, exc)
        if translated is None:
            raise
        raise translated from exc


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _strip_uuid_prefix(uuid: str) -> str:
    for prefix in ("GPU-", "MIG-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix) :]
    return uuid


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """One NVML device (a physical GPU or a MIG instance) before its memory is read."""

    nvml_index: int
    handle: Any
    uuid: str
    name: str
    is_mig: bool
    parent_uuid: str
    mig_enabled: bool
    """A physical GPU in MIG mode: CUDA sees its instances, not the GPU itself."""


def _keep_one_mig(uuids: list[str], entries: list[_Entry]) -> list[str]:
    """CUDA 11 and 12 enumerate at most one MIG instance per process (NVIDIA MIG user guide)."""
    mig_uuids = {entry.uuid for entry in entries if entry.is_mig}
    kept: list[str] = []
    seen_mig = False
    for uuid in uuids:
        if uuid in mig_uuids:
            if seen_mig:
                continue
            seen_mig = True
        kept.append(uuid)
    return kept


def _cuda_uuid_of(entry: _Entry, entries: list[_Entry]) -> str | None:
    """The UUID CUDA shows for ``entry``: a GPU in MIG mode shows its first instance."""
    if not entry.mig_enabled:
        return entry.uuid
    children = [child.uuid for child in entries if child.parent_uuid == entry.uuid]
    return children[0] if children else None


def _leading_int(token: str) -> int | None:
    """``strtoul``-style: ``"1gpu"`` is 1, ``"x"`` and ``"-1"`` are None."""
    digits = ""
    for char in token.lstrip("+"):
        if not char.isdigit():
            break
        digits += char
    return int(digits) if digits else None


def _cuda_order(spec: str | None, entries: list[_Entry]) -> list[str]:
    """The UUIDs CUDA numbers 0, 1, ... under ``CUDA_VISIBLE_DEVICES=spec`` (None: unset).

    Follows the CUDA driver: entries are indices into the default order or unique prefixes of
    ``GPU-``/``MIG-`` UUIDs; the first invalid entry ends the list; a repeated device empties it.
    The default order is NVML's (PCI bus) order, which is CUDA's under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or on identical GPUs.
    """
    physical = (_cuda_uuid_of(entry, entries) for entry in entries if not entry.is_mig)
    default = _keep_one_mig([uuid for uuid in physical if uuid is not None], entries)
    if spec is None:
        return default
    order: list[str] = []
    for raw_token in spec.split(","):
        token = raw_token.strip()
        uuid: str | None
        if token.startswith(("GPU-", "MIG-")):
            matches = [entry for entry in entries if entry.uuid.startswith(token)]
            uuid = _cuda_uuid_of(matches[0], entries) if len(matches) == 1 else None
        else:
            index = _leading_int(token)
            uuid = default[index] if index is not None and index < len(default) else None
        if uuid is None:
            break
        if uuid in order:
            return []
        order.append(uuid)
    return _keep_one_mig(order, entries)


class Nvml:
    """NVML queries, with lazy one-time initialisation and translated errors.

    Args:
        module: the pynvml module to use; None imports ``pynvml`` on first use. Tests pass a fake.
        environ: where ``CUDA_VISIBLE_DEVICES`` is read; None reads ``os.environ`` at each query.
        pid: this process's id, excluded from other processes' memory; None is ``os.getpid()``.
        torch_mem_get_info: the fallback when NVML does not report a GPU's memory; None uses
            ``torch.cuda.mem_get_info`` for devices torch can see.

    A failed initialisation is not remembered: the next query tries again.
    """

    def __init__(
        self,
        module: Any = None,
        *,
        environ: Mapping[str, str] | None = None,
        pid: int | None = None,
        torch_mem_get_info: TorchMemGetInfo | None = None,
    ) -> None:
        self._module = module
        self._environ = environ
        self._pid = os.getpid() if pid is None else pid
        self._torch_mem_get_info = torch_mem_get_info or _torch_mem_get_info
        self._lib: Any = None
        self._init_lock = threading.Lock()

    def _library(self) -> Any:
        """The initialised pynvml module."""
        lib = self._lib
        if lib is not None:
            return lib
        with self._init_lock:
            if self._lib is None:
                module = self._module
                if module is None:
                    with _nvml_errors(None, "import pynvml"):
                        module = _import_pynvml()
                with _nvml_errors(module, "initialise"):
                    module.nvmlInit()
                self._lib = module
            return self._lib

    def _visible_devices_spec(self) -> str | None:
        environ = os.environ if self._environ is None else self._environ
        return environ.get(_VISIBLE_DEVICES_VAR)

    def _entries(self, lib: Any) -> list[_Entry]:
        entries: list[_Entry] = []
        for nvml_index in range(lib.nvmlDeviceGetCount()):
            handle = lib.nvmlDeviceGetHandleByIndex(nvml_index)
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
            try:
                current_mode, _pending_mode = lib.nvmlDeviceGetMigMode(handle)
                mig_enabled = current_mode == lib.NVML_DEVICE_MIG_ENABLE
            except _error_classes(lib, _NOT_SUPPORTED_ERRORS):
                mig_enabled = False
            name = _text(lib.nvmlDeviceGetName(handle))
            entries.append(_Entry(nvml_index, handle, uuid, name, False, "", mig_enabled))
            if mig_enabled:
                entries.extend(self._mig_entries(lib, nvml_index, handle, uuid))
        return entries

    def _mig_entries(self, lib: Any, nvml_index: int, handle: Any, uuid: str) -> list[_Entry]:
        found: list[_Entry] = []
        for slot in range(lib.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig_handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except _error_classes(lib, _EMPTY_MIG_SLOT_ERRORS):
                continue  # no instance in this slot
            mig_uuid = _text(lib.nvmlDeviceGetUUID(mig_handle))
            mig_name = _text(lib.nvmlDeviceGetName(mig_handle))
            found.append(_Entry(nvml_index, mig_handle, mig_uuid, mig_name, True, uuid, False))
        return found

    def _memory(self, lib: Any, entry: _Entry, cuda_index: int | None) -> MemoryInfo:
        """The driver's view of ``entry``'s memory; ``free`` is always the driver's own field."""
        try:
            return _nvml_memory(lib, entry.handle)
        except _error_classes(lib, _NOT_SUPPORTED_ERRORS) as exc:
            fallback = None if cuda_index is None else self._torch_mem_get_info(cuda_index)
            if fallback is None:
                action = f"read the memory of GPU {entry.uuid} (nor can torch)"
                translated = _translate(lib, action, exc)
                assert translated is not None  # NotSupported is an NVMLError
                raise translated from exc
        free_bytes, total_bytes = fallback
        return MemoryInfo(
            total_memory_bytes=total_bytes,
            free_memory_bytes=free_bytes,
            used_memory_bytes=total_bytes - free_bytes,
        )

    def _gpu_infos(self, lib: Any) -> list[GpuInfo]:
        entries = self._entries(lib)
        order = _cuda_order(self._visible_devices_spec(), entries)
        cuda_indices = {uuid: cuda_index for cuda_index, uuid in enumerate(order)}
        gpus: list[GpuInfo] = []
        for entry in entries:
            cuda_index = cuda_indices.get(entry.uuid)
            gpus.append(
                GpuInfo(
                    nvml_index=entry.nvml_index,
                    cuda_index=cuda_index,
                    uuid=entry.uuid,
                    name=entry.name,
                    memory=self._memory(lib, entry, cuda_index),
                    is_mig=entry.is_mig,
                    parent_uuid=entry.parent_uuid,
                )
            )
        return gpus

    def list_gpus(self) -> list[GpuInfo]:
        """Every GPU NVML sees, in NVML order, each GPU in MIG mode followed by its instances.

        Returns:
            One :class:`GpuInfo` per physical GPU and per MIG instance (a MIG instance carries
            its own memory and ``parent_uuid``; a GPU in MIG mode has ``cuda_index`` None, since
            CUDA sees its instances instead).

        Raises:
            DeviceUnavailableError: no driver or libnvidia-ml, or a query failed (GPU lost, no
                permission), or neither NVML nor torch reports some GPU's memory.
        """
        lib = self._library()
        with _nvml_errors(lib, "list GPUs"):
            return self._gpu_infos(lib)

    def gpu_for_cuda_index(self, cuda_index: int) -> GpuInfo:
        """The GPU torch calls ``cuda:cuda_index`` under this process's ``CUDA_VISIBLE_DEVICES``.

        Raises:
            DeviceUnavailableError: that index is not visible (the message gives the visible
                count and ``CUDA_VISIBLE_DEVICES``), or NVML is unavailable.
        """
        gpus = self.list_gpus()
        for gpu in gpus:
            if gpu.cuda_index == cuda_index:
                return gpu
        num_visible = sum(gpu.cuda_index is not None for gpu in gpus)
        raise DeviceUnavailableError(
            f"CUDA device {cuda_index} is not visible: this process sees {num_visible} CUDA "
            f"device(s) ({_VISIBLE_DEVICES_VAR}={self._visible_devices_spec()!r})."
        )

    def gpu_for_uuid(self, uuid: str) -> GpuInfo:
        """The GPU or MIG instance with this UUID, with or without its ``GPU-``/``MIG-`` prefix.

        Raises:
            DeviceUnavailableError: no such device, or NVML is unavailable.
        """
        wanted = _strip_uuid_prefix(uuid)
        for gpu in self.list_gpus():
            if _strip_uuid_prefix(gpu.uuid) == wanted:
                return gpu
        raise DeviceUnavailableError(f"NVML lists no GPU with UUID {uuid!r}.")

    def driver_version(self) -> str:
        """The NVIDIA driver's version, e.g. ``"550.54.15"``.

        Raises:
            DeviceUnavailableError: no driver or libnvidia-ml.
        """
        lib = self._library()
        with _nvml_errors(lib, "read the driver version"):
            return _text(lib.nvmlSystemGetDriverVersion())

    def foreign_process_memory_bytes(self, uuid: str) -> int | None:
        """Bytes that other processes' CUDA contexts hold on the GPU with this UUID.

        Processes are matched by pid; inside a container NVML reports host pids, so this process
        may be counted as foreign there.

        Returns:
            The sum of ``usedGpuMemory`` over compute processes other than this one, in bytes;
            None when the driver does not report it (NotSupported, or per-process memory
            unavailable as under Windows WDDM).

        Raises:
            DeviceUnavailableError: no such GPU, or NVML is unavailable.
        """
        lib = self._library()
        with _nvml_errors(lib, "list the processes on a GPU"):
            wanted = _strip_uuid_prefix(uuid)
            entries = [e for e in self._entries(lib) if _strip_uuid_prefix(e.uuid) == wanted]
            if not entries:
                raise DeviceUnavailableError(f"NVML lists no GPU with UUID {uuid!r}.")
            unsupported = _error_classes(lib, (*_NOT_SUPPORTED_ERRORS, "NVMLLibraryMismatchError"))
            try:
                processes = lib.nvmlDeviceGetComputeRunningProcesses(entries[0].handle)
            except unsupported:
                return None
            used = [p.usedGpuMemory for p in processes if p.pid != self._pid]
            if any(used_bytes is None for used_bytes in used):
                return None
            return sum(int(used_bytes) for used_bytes in used)


def _nvml_memory(lib: Any, handle: Any) -> MemoryInfo:
    """nvmlDeviceGetMemoryInfo v2 (``used`` without the driver's reserve), else v1."""
    version = getattr(lib, "nvmlMemory_v2", None)
    if version is not None:
        try:
            memory = lib.nvmlDeviceGetMemoryInfo(handle, version=version)
        except _error_classes(lib, _NO_V2_MEMORY_ERRORS):
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
    """:meth:`Nvml.list_gpus` on :func:`default_nvml`; what ``autobatch gpus`` prints."""
    return default_nvml().list_gpus()


def gpu_for_cuda_index(cuda_index: int) -> GpuInfo:
    """:meth:`Nvml.gpu_for_cuda_index` on :func:`default_nvml`."""
    return default_nvml().gpu_for_cuda_index(cuda_index)


def driver_version() -> str:
    """:meth:`Nvml.driver_version` on :func:`default_nvml`."""
    return default_nvml().driver_version()
