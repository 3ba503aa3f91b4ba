"""NVML's failures, in one place: each exception (or a missing library) becomes a
:class:`~autobatch.errors.DeviceUnavailableError` with a stable ``reason`` code
(:data:`REASONS`) whose text says what to do.

Imports no ``pynvml``: the exception classes are looked up by name on the module
:mod:`autobatch.device._nvml` passes in (older bindings may lack some), so one table serves the
real bindings and the tests' fake. A CUDA toolkit's stub ``libnvidia-ml.so`` (it only serves
linking) is told from the driver's by the loaded libraries' paths, since what the stub raises
does not name that cause.

Example::

    with nvml_errors(pynvml, "list GPUs"):
        pynvml.nvmlDeviceGetCount()     # NVMLError_DriverNotLoaded -> reason "driver_not_loaded"
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from autobatch.errors import DeviceUnavailableError, Remedy

__all__ = [
    "NOT_SUPPORTED_ERRORS",
    "REASONS",
    "REMEDIES",
    "error_classes",
    "is_stub",
    "loaded_library_paths",
    "nvml_errors",
    "reason_of",
    "translate",
]


REASONS: dict[str, str] = {
    "pynvml_missing": "the nvidia-ml-py package is not installed: pip install nvidia-ml-py",
    "library_missing": "libnvidia-ml.so.1 was not found: run the container with the NVIDIA "
    "runtime (Kubernetes runtimeClassName: nvidia, docker --gpus) so the driver's library is "
    "mounted, or install the NVIDIA driver",
    "cuda_stub_library": "the CUDA toolkit's stub libnvidia-ml.so was loaded (it only serves "
    "linking): remove the toolkit's stubs directory from LD_LIBRARY_PATH so the driver's "
    "libnvidia-ml.so.1 loads",
    "driver_not_loaded": "the NVIDIA kernel driver is not loaded: install or load it (modprobe "
    "nvidia; nvidia-smi must work)",
    "driver_library_mismatch": "the NVIDIA kernel module and libnvidia-ml are different versions "
    "(LibRmVersionMismatch, usually a driver upgrade without a reboot): reload the nvidia kernel "
    "modules or reboot the node",
    "bindings_mismatch": "nvidia-ml-py called a function this libnvidia-ml lacks: install an "
    "nvidia-ml-py no newer than the driver",
    "no_permission": "NVML refused the query (NoPermission; MIG parents inside containers): "
    "query the MIG instance, or run with the permission",
    "not_supported": "NVML does not report this (NotSupported; unified-memory boards, some WSL "
    "setups, MIG parents): the memory comes from the CUDA runtime or the host, or is unknown",
    "zero_total": "NVML reported a total of 0 bytes, which is read as unknown",
    "gpu_lost": "the GPU fell off the bus or needs a reset (GpuIsLost): drain the node and reset "
    "the GPU (nvidia-smi -r) or reboot",
    "nvml_timeout": "an NVML call did not return in time (a hung driver): the reading is retried "
    "on the next request; if it persists, check the driver (dmesg, nvidia-smi)",
    "nvml_error": "NVML failed; the message names the call and the error",
}
"""Stable ``reason`` codes of NVML failures, each with what to do; docs/service.md lists them.
The texts name no surface's spelling: a fix that is an argument is in :data:`REMEDIES`."""

_NO_GPU = Remedy(
    parameter="device", values=("cpu", "sim:SIZE"), purpose="on a machine without a GPU"
)

REMEDIES: dict[str, tuple[Remedy, ...]] = {
    "library_missing": (_NO_GPU,),
    "driver_not_loaded": (_NO_GPU,),
}
"""The fixes of a reason that are an argument (another device), for each surface to word:
``device='cpu'`` in Python, ``--device cpu`` on the command line, ``"device": "cpu"`` over
HTTP."""

_NO_NVML_REASONS = frozenset(
    {
        "pynvml_missing",
        "library_missing",
        "cuda_stub_library",
        "driver_not_loaded",
        "driver_library_mismatch",
    }
)
"""Reasons that mean "no usable NVML on this machine", not "this query failed"."""
_LIBRARY_MISSING_ERRORS = ("NVMLError_LibraryNotFound",)
_DRIVER_NOT_LOADED_ERRORS = ("NVMLError_DriverNotLoaded",)
_VERSION_MISMATCH_ERRORS = ("NVMLError_LibRmVersionMismatch",)
_GPU_LOST_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired", "NVMLError_GpuNotFound")
NOT_SUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")


def loaded_library_paths() -> list[str]:
    """Paths of the shared objects mapped into this process (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return sorted({line.split()[-1] for line in maps if "/" in line})
    except OSError:
        return []


def error_classes(lib: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The named exception classes of ``lib`` (older bindings may lack some)."""
    found = (getattr(lib, name, None) for name in names)
    return tuple(cls for cls in found if isinstance(cls, type))


def reason_of(lib: Any, exc: BaseException) -> str:
    """The :data:`REASONS` code of one of NVML's exceptions (or a missing library)."""
    if isinstance(exc, ImportError):
        return "pynvml_missing"
    if isinstance(exc, OSError):
        return "library_missing"
    table = (
        (_LIBRARY_MISSING_ERRORS, "library_missing"),
        (_DRIVER_NOT_LOADED_ERRORS, "driver_not_loaded"),
        (_VERSION_MISMATCH_ERRORS, "driver_library_mismatch"),
        (("NVMLLibraryMismatchError",), "bindings_mismatch"),
        (_GPU_LOST_ERRORS, "gpu_lost"),
        (("NVMLError_NoPermission",), "no_permission"),
        (NOT_SUPPORTED_ERRORS, "not_supported"),
        (("NVMLError_Timeout",), "nvml_timeout"),
    )
    for names, reason in table:
        if isinstance(exc, error_classes(lib, names)):
            return reason
    return "nvml_error"


def translate(
    lib: Any, action: str, exc: BaseException, *, stub_path: str = ""
) -> DeviceUnavailableError | None:
    """The :class:`DeviceUnavailableError` for one of NVML's exceptions; None for any other.

    The only place NVML's exceptions are translated; :func:`nvml_errors` applies it to a block.

    Args:
        lib: the pynvml module (None before it is imported).
        action: what was being done, for the message, e.g. ``"list GPUs"``.
        exc: what was raised. ``ImportError``/``OSError`` (no library), every ``NVMLError_*``
            and pynvml's ``NVMLLibraryMismatchError`` are translated.
        stub_path: the CUDA toolkit's stub libnvidia-ml when it is the one loaded: the reason
            is then ``cuda_stub_library`` whatever the stub answered.

    Returns:
        The error, its ``reason`` one of :data:`REASONS`, its message the cause and the fix.
    """
    if not isinstance(exc, (ImportError, OSError)) and not isinstance(
        exc, error_classes(lib, ("NVMLError", "NVMLLibraryMismatchError"))
    ):
        return None
    reason = "cuda_stub_library" if stub_path else reason_of(lib, exc)
    cause = f"{exc} ({type(exc).__name__})"
    if stub_path:
        cause = f"{stub_path}; {cause}"
    if reason in _NO_NVML_REASONS:
        # In brackets: the cause ends in a parenthesis, and one inside another reads "))".
        message = f"NVML is not available: {REASONS[reason]} [{cause}]"
    else:
        message = f"NVML could not {action}: {cause}; {REASONS[reason]}"
    remedies = REMEDIES.get(reason, ())
    end = "" if remedies else "."
    return DeviceUnavailableError(message + end, reason=reason, remedies=remedies)


@contextlib.contextmanager
def nvml_errors(lib: Any, action: str, *, stub_path: str = "") -> Iterator[None]:
    """Raise :func:`translate`'s error ``from`` NVML's; other exceptions propagate unchanged."""
    try:
        yield
    except Exception as exc:
        translated = translate(lib, action, exc, stub_path=stub_path)
        if translated is None:
            raise
        raise translated from exc


def is_stub(path: str) -> bool:
    """Whether ``path`` is the CUDA toolkit's stub libnvidia-ml, not the driver's."""
    return "/stubs/" in path and os.path.basename(path).startswith("libnvidia-ml.so")
