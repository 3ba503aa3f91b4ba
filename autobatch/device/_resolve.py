"""Which device a string names: ``"cuda:N"``, ``"cpu"``, ``"sim:SIZE"``, or the model's own.

Example::

    resolve_device("sim:2GiB").capacity().capacity_bytes      # 2147483648
    parse_device("cuda:1").cuda_index                          # 1
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from autobatch.device._budget import check_gpu_fraction
from autobatch.device._types import Device
from autobatch.errors import ConfigError
from autobatch.units import parse_capacity

if TYPE_CHECKING:
    import torch

__all__ = ["NAMED_SIM_STEP_SECONDS", "ParsedDevice", "parse_device", "resolve_device"]

NAMED_SIM_STEP_SECONDS: float | None = None
"""Seconds each real step of a simulated card named by a string (``"sim:2GiB"``) counts on its
clock; None: the wall clock, what the step really cost on this CPU. The probe weighs the estimate's
fake steps against real ones on that clock, so on the wall clock its road (estimate or not) can
change with the machine's load. The test suite sets a number here, as it sets the probe's own
clock (``ProbeOptions.clock``), so that every probe it makes takes the same road on any machine."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParsedDevice:
    """A device string understood: ``cuda:N``, ``cpu`` or ``sim:SIZE`` (no torch needed)."""

    type: Literal["cuda", "cpu", "sim"]
    cuda_index: int | None = None
    """torch's CUDA index for ``cuda:N`` (``"cuda"`` alone is 0); None otherwise."""
    capacity_bytes: int | None = None
    """The simulated card's memory for ``sim:SIZE``, bytes; None otherwise."""

    def __str__(self) -> str:
        if self.type == "cuda":
            return f"cuda:{self.cuda_index}"
        if self.type == "sim":
            return f"sim:{self.capacity_bytes}"
        return "cpu"


def parse_device(text: str) -> ParsedDevice:
    """The one parser of device strings, shared by the library, the CLI and the service.

    Args:
        text: ``"cuda:N"`` (``"cuda"`` is ``"cuda:0"``), ``"cpu"``, or ``"sim:SIZE"`` with a memory
            size such as ``"sim:2GiB"`` (see :func:`autobatch.units.parse_capacity`: a bare
            number under 1 MiB, ``"sim:3"``, is refused as a unit left off); surrounding blanks
            are ignored.

    Raises:
        ConfigError: anything else (names the value and the accepted forms).
    """
    if not isinstance(text, str):
        raise ConfigError(
            f"device {text!r} is not a device; pass 'cuda:N', 'cpu', 'sim:SIZE' or a Device"
        )
    kind, sep, rest = text.strip().partition(":")
    if kind == "sim":
        if not rest.strip():
            raise ConfigError(f"device {text!r}: give the simulated capacity, e.g. 'sim:2GiB'")
        return ParsedDevice(type="sim", capacity_bytes=parse_capacity(rest.strip(), prefix="sim:"))
    if kind == "cpu" and not sep:
        return ParsedDevice(type="cpu")
    if kind == "cuda":
        index = rest if sep else "0"
        if not (index.isascii() and index.isdigit()):
            raise ConfigError(f"device {text!r}: the CUDA index must be a number, e.g. 'cuda:0'")
        return ParsedDevice(type="cuda", cuda_index=int(index))
    raise ConfigError(f"device {text!r} is not understood; use 'cuda:N', 'cpu' or 'sim:SIZE'")


def resolve_device(
    spec: str | Device | None,
    *,
    default: torch.device | None = None,
    gpu_fraction: float | None = None,
) -> Device:
    """Turn ``"cuda:0"``, ``"cpu"``, ``"sim:2GiB"`` (see :func:`parse_device`), a Device, or None
    into a Device.

    Args:
        spec: the device. None means ``default`` (typically the model's device).
        default: used when ``spec`` is None.
        gpu_fraction: the share of the card the job is declared to get, in (0, 1] (Ray's
            ``num_gpus=0.5`` is 0.5); it joins the device's memory budget
            (:mod:`autobatch.device._budget`). A GPU's or a simulated card's only; a Device of
            your own needs a ``with_gpu_fraction(fraction)`` method for it.

    Raises:
        ConfigError: the spec is not understood (names the value and the accepted forms), or
            ``gpu_fraction`` is not in (0, 1] or given for a device that is no GPU.
        DeviceUnavailableError: CUDA was asked for but is not available.
    """
    fraction = check_gpu_fraction(gpu_fraction)
    if isinstance(spec, Device):
        if fraction is None:
            return spec
        share = getattr(spec, "with_gpu_fraction", None)
        if share is None:
            raise ConfigError(
                f"gpu_fraction {fraction} needs a GPU, but {spec!r} has no with_gpu_fraction() "
                "method; build the device with its fraction (CudaDevice(0, gpu_fraction=...), "
                "SimulatedDevice(..., gpu_fraction=...)) or leave gpu_fraction unset"
            )
        shared: Device = share(fraction)
        return shared
    if spec is None:
        spec = str(default) if default is not None else "cpu"
    parsed = parse_device(spec)
    if parsed.type == "sim":
        # Each device's module is torch-bound: it loads when its kind is asked for.
        from autobatch.device._simulated import SimulatedDevice

        assert parsed.capacity_bytes is not None
        # Named by a string (the CLI, the service, a script): its steps really run on this
        # machine's CPU, and the probe weighs them at what they really cost (the wall clock).
        return SimulatedDevice(
            capacity_bytes=parsed.capacity_bytes,
            gpu_fraction=fraction,
            step_seconds=NAMED_SIM_STEP_SECONDS,
        )
    if parsed.type == "cpu":
        from autobatch.device._cpu import CpuDevice

        if fraction is not None:
            raise ConfigError(
                f"gpu_fraction {fraction} is a share of a GPU, but the device is the CPU: leave "
                "it unset (a container's memory limit is read from its cgroup)"
            )
        return CpuDevice()
    from autobatch.device._cuda import CudaDevice

    assert parsed.cuda_index is not None
    return CudaDevice(cuda_index=parsed.cuda_index, gpu_fraction=fraction)
