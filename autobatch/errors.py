"""Exceptions raised by autobatch.

Every error autobatch raises on purpose derives from :class:`AutobatchError`::

    AutobatchError
    ├── ConfigError (also ValueError)  bad argument or input; names the value and the fix
    ├── DeviceUnavailableError         no such device, no NVML/driver, device query failed
    ├── DoesNotFitError                the training step does not fit even at micro-batch 1
    ├── StepFailedError                the user's step failed for a reason other than OOM
    ├── NoFeasiblePlanError            no (micro-batch, accumulation) split meets the constraints
    ├── StoreError                     the profile store is corrupt, newer, or unwritable
    ├── DistributedError               a rank failed or ranks disagreed during a collective probe
    └── ServiceError                   the HTTP service refused or failed a call (client side)

Foreign exceptions (``pynvml.NVMLError_*``, ``torch.OutOfMemoryError``) are translated at the device
boundary only (``autobatch.device``), with ``raise ... from exc``.

Example::

    try:
        profile = autobatch.probe(model, sample, device="sim:2GiB")
    except autobatch.DoesNotFitError as exc:
        print(exc.required_bytes, exc.capacity_bytes)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AutobatchError",
    "ConfigError",
    "DeviceUnavailableError",
    "DistributedError",
    "DoesNotFitError",
    "NoFeasiblePlanError",
    "ServiceError",
    "StepFailedError",
    "StoreError",
]


class AutobatchError(Exception):
    """Root of every error autobatch raises on purpose."""


class ConfigError(AutobatchError, ValueError):
    """An argument or input is invalid. The message names the value and how to fix it."""


class DeviceUnavailableError(AutobatchError):
    """The device cannot be used: unknown name, no driver/NVML, or a failed query.

    Attributes:
        reason: a stable code a program can switch on, e.g. ``"driver_library_mismatch"``
            or ``"gpu_lost"`` (``autobatch.device.nvml.REASONS`` lists NVML's, each with its
            fix); ``"device_unavailable"`` when nothing more specific is known.
    """

    def __init__(self, message: str, *, reason: str = "device_unavailable") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_device_unavailable, (str(self), self.reason)


def _rebuild_device_unavailable(message: str, reason: str) -> DeviceUnavailableError:
    return DeviceUnavailableError(message, reason=reason)


class DoesNotFitError(AutobatchError):
    """The whole training step does not fit on the device even at micro-batch 1.

    Attributes:
        device_name: the device probed.
        capacity_bytes: bytes the step may use on it.
        required_bytes: bytes the step needed when it failed (a lower bound), 0 if unknown.
        static_bytes: the model's resident footprint (weights, gradients, optimizer state), bytes.
    """

    def __init__(
        self,
        message: str,
        *,
        device_name: str,
        capacity_bytes: int,
        required_bytes: int,
        static_bytes: int,
    ) -> None:
        super().__init__(message)
        self.device_name = device_name
        self.capacity_bytes = capacity_bytes
        self.required_bytes = required_bytes
        self.static_bytes = static_bytes


class StepFailedError(AutobatchError):
    """The training step raised something other than out-of-memory.

    Attributes:
        micro_batch_size: the size at which it failed.
    """

    def __init__(self, message: str, *, micro_batch_size: int) -> None:
        super().__init__(message)
        self.micro_batch_size = micro_batch_size


class NoFeasiblePlanError(AutobatchError):
    """No split of the effective batch meets every constraint; names the nearest reachable ones."""


class StoreError(AutobatchError):
    """The profile store cannot be used: corrupt file, newer schema, or not writable."""


class DistributedError(AutobatchError):
    """A rank failed or the ranks disagreed while probing under torch.distributed."""


class ServiceError(AutobatchError):
    """The service refused or failed a call for a reason with no closer autobatch error
    (401 bad token, 409 queue full, 5xx, unreachable server).

    Attributes:
        status: the HTTP status, 0 when no response came.
        problem: the problem details body, empty when none.
    """

    def __init__(self, message: str, *, status: int, problem: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.problem = dict(problem or {})
