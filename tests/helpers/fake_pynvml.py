"""A hand-written stand-in for nvidia-ml-py's ``pynvml`` module, for ``autobatch.device._nvml``.

It keeps the real module's names (functions, constants, ``NVMLError_*`` classes built from the
same error codes) and its behaviour where autobatch depends on it: queries before ``nvmlInit``
raise ``NVMLError_Uninitialized``, an empty MIG slot raises ``NVMLError_NotFound``, memory v1's
``used`` is ``total - free`` while v2 splits off the driver's ``reserved``.

Example::

    fake = FakePynvml([FakeGpu(uuid="GPU-aaaa", name="NVIDIA A100", total=80 * GiB, free=79 * GiB)])
    Nvml(fake, environ={}).list_gpus()
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

GiB = 1024**3
MiB = 1024**2

ERROR_CODES = {
    "Uninitialized": 1,
    "InvalidArgument": 2,
    "NotSupported": 3,
    "NoPermission": 4,
    "AlreadyInitialized": 5,
    "NotFound": 6,
    "InsufficientSize": 7,
    "InsufficientPower": 8,
    "DriverNotLoaded": 9,
    "Timeout": 10,
    "IrqIssue": 11,
    "LibraryNotFound": 12,
    "FunctionNotFound": 13,
    "CorruptedInforom": 14,
    "GpuIsLost": 15,
    "ResetRequired": 16,
    "OperatingSystem": 17,
    "LibRmVersionMismatch": 18,
    "InUse": 19,
    "Memory": 20,
    "NoData": 21,
    "VgpuEccNotSupported": 22,
    "InsufficientResources": 23,
    "FreqNotSupported": 24,
    "ArgumentVersionMismatch": 25,
    "Deprecated": 26,
    "NotReady": 27,
    "GpuNotFound": 28,
    "InvalidState": 29,
    "ResetTypeNotSupported": 30,
    "Unknown": 999,
}
"""``NVML_ERROR_*`` codes; the real module names each class ``NVMLError_<CapWords>``."""


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return f"fake NVML error {type(self).__name__.removeprefix('NVMLError_')} ({self.value})"


class NVMLLibraryMismatchError(Exception):
    pass


ERROR_CLASSES: dict[str, type[NVMLError]] = {
    f"NVMLError_{name}": type(f"NVMLError_{name}", (NVMLError,), {"value": code})
    for name, code in ERROR_CODES.items()
}
globals().update(ERROR_CLASSES)
NVMLError_NotSupported = ERROR_CLASSES["NVMLError_NotSupported"]
NVMLError_NotFound = ERROR_CLASSES["NVMLError_NotFound"]
NVMLError_Uninitialized = ERROR_CLASSES["NVMLError_Uninitialized"]


@dataclasses.dataclass
class FakeGpu:
    """One physical GPU or MIG instance; it is also its own NVML handle."""

    uuid: str
    name: str
    total: int
    free: int
    used_v2: int = 0
    """v2 ``used`` (without the driver's reserve); v1 ``used`` is ``total - free``."""
    reserved_v2: int = 0
    mig_mode: int | None = None
    """1 enabled, 0 disabled, None: nvmlDeviceGetMigMode raises NotSupported."""
    mig_slots: dict[int, FakeGpu] = dataclasses.field(default_factory=dict)
    max_mig_devices: int = 7
    memory_v2_error: type[Exception] | None = None
    memory_v1_error: type[Exception] | None = None
    memory_gate: threading.Event | None = None
    """When set, a memory query blocks until the event is set (a hung driver)."""
    memory_delay_s: float = 0.0
    """A memory query sleeps this long first (a slow or hung driver, in another process)."""
    num_cores: int | None = None
    """nvmlDeviceGetNumGpuCores; None: NotSupported."""
    max_sm_clock_mhz: int | None = None
    """nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM); None: NotSupported."""
    addressing_mode: int | None = None
    """nvmlDeviceGetAddressingMode (2: ATS, unified memory); None: NotSupported."""


class FakePynvml:
    """Use an instance where the ``pynvml`` module goes.

    Args:
        gpus: the physical GPUs in NVML order.
        driver_version: what ``nvmlSystemGetDriverVersion`` answers (str, or bytes as old bindings).
        init_errors: raised by successive ``nvmlInit`` calls, one each, before it succeeds.
        init_delay_s: ``nvmlInit`` sleeps this long (to widen races).
        init_error: raised by every ``nvmlInit`` (a machine without a driver).
    """

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = 0x02000028
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_CLOCK_SM = 1
    NVML_DEVICE_ADDRESSING_MODE_NONE = 0
    NVML_DEVICE_ADDRESSING_MODE_HMM = 1
    NVML_DEVICE_ADDRESSING_MODE_ATS = 2

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver_version: str | bytes = "550.54.15",
        init_errors: list[BaseException] | None = None,
        init_delay_s: float = 0.0,
        init_error: type[BaseException] | None = None,
    ) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.init_errors = list(init_errors or [])
        self.init_delay_s = init_delay_s
        self.init_error = init_error
        self.num_init_calls = 0
        self.memory_calls: list[tuple[str, int | None]] = []
        self.count_error: BaseException | None = None
        self._initialised = False
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name in ERROR_CLASSES:
            return ERROR_CLASSES[name]
        raise AttributeError(name)

    def _check(self) -> None:
        if not self._initialised:
            raise NVMLError_Uninitialized()

    def nvmlInit(self) -> None:
        with self._lock:
            self.num_init_calls += 1
        time.sleep(self.init_delay_s)
        if self.init_errors:
            raise self.init_errors.pop(0)
        if self.init_error is not None:
            raise self.init_error()
        self._initialised = True

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._check()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        if self.count_error is not None:
            raise self.count_error
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._check()
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        self._check()
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        self._check()
        self.memory_calls.append((handle.uuid, version))
        if handle.memory_gate is not None:
            handle.memory_gate.wait()
        time.sleep(handle.memory_delay_s)
        if version is None:
            if handle.memory_v1_error is not None:
                raise handle.memory_v1_error()
            used = handle.total - handle.free
            return SimpleNamespace(total=handle.total, free=handle.free, used=used)
        assert version == self.nvmlMemory_v2
        if handle.memory_v2_error is not None:
            raise handle.memory_v2_error()
        return SimpleNamespace(
            version=version,
            total=handle.total,
            reserved=handle.reserved_v2,
            free=handle.free,
            used=handle.used_v2,
        )

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        self._check()
        if handle.mig_mode is None:
            raise NVMLError_NotSupported()
        return [handle.mig_mode, handle.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        self._check()
        return handle.max_mig_devices if handle.mig_mode else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        self._check()
        if index not in handle.mig_slots:
            raise NVMLError_NotFound()
        return handle.mig_slots[index]

    def nvmlDeviceGetNumGpuCores(self, handle: FakeGpu) -> int:
        self._check()
        if handle.num_cores is None:
            raise NVMLError_NotSupported()
        return handle.num_cores

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeGpu, clock_type: int) -> int:
        self._check()
        assert clock_type == self.NVML_CLOCK_SM
        if handle.max_sm_clock_mhz is None:
            raise NVMLError_NotSupported()
        return handle.max_sm_clock_mhz

    def nvmlDeviceGetAddressingMode(self, handle: FakeGpu) -> int:
        self._check()
        if handle.addressing_mode is None:
            raise NVMLError_NotSupported()
        return handle.addressing_mode
