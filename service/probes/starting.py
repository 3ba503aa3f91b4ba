"""Starting a probe run: the model must be registered, and a ``cuda:N`` device one this
container was given, before the run is queued.

Example::

    run = await start_run(ProbeCreate(model="tiny-mlp"), state.runs, state.gpus)
"""

from __future__ import annotations

from autobatch.errors import DeviceUnavailableError
from service.devices.gpus import HEALTH_FAILURES, GpuMonitor
from service.probes.registry import cuda_index
from service.probes.runs import ProbeRun, ProbeRuns, UnknownModelError
from service.probes.schemas import ProbeCreate
from service.web.problems import Problem
from service.web.wording import describe

__all__ = ["start_run"]


async def start_run(body: ProbeCreate, runs: ProbeRuns, gpus: GpuMonitor) -> ProbeRun:
    """Queue the run that ``body`` asks for, once its device is known to be here.

    Raises:
        Problem: 404 ``unknown-model`` for a model not in the registry; 422 ``unknown-device``
            for a ``cuda:N`` this container was not given.
        QueueFullError: the device's queue is full (409).
        DeviceUnavailableError: NVML hangs or lost a GPU (503).
    """
    entry = runs.registry.models.get(body.model)
    if entry is not None:
        await _check_cuda_device(body.device or entry.device, gpus, body.device is None)
    try:
        return runs.submit(body.model, device=body.device, refresh=body.refresh)
    except UnknownModelError as exc:
        raise Problem(404, "unknown-model", describe(exc), field="body.model") from exc


async def _check_cuda_device(device: str, gpus: GpuMonitor, from_registry: bool) -> None:
    """422 now, rather than a run failing seconds later, for ``cuda:N`` with no such GPU in the
    device set this container was given (the run's child sees the same numbering)."""
    index = cuda_index(device)
    if index is None:
        return
    try:
        inventory = await gpus.inventory()
        visible = sorted(d.cuda_index for d in inventory.devices if d.cuda_index is not None)
    except DeviceUnavailableError as exc:
        if exc.reason in HEALTH_FAILURES:
            raise  # NVML hangs or lost a GPU: 503, not "no such device"
        # The cause alone: the remedy (a device this node has) is the request's field, below.
        reason = f"this node has no usable GPU: {exc.message.rstrip('.')}"
    else:
        if index in visible:
            return
        reason = f"this node has no GPU with CUDA index {index} (visible: {visible or 'none'})"
    where = "the registry's device for this model" if from_registry else "device"
    raise Problem(
        422,
        "unknown-device",
        f'{where} {device!r}: {reason}; give "device" a device this node has: "cpu", or '
        '"sim:16GiB" (a simulated card)',
        field="body.model" if from_registry else "body.device",
    )
