"""GPU readings for the service, never on the event loop and never waited on for long.

Every NVML call runs in a worker thread: one for the device listing, one per device for its
memory, each with at most one call in flight (requests that arrive meanwhile share it; a hung
driver never costs a new thread per request). A request waits for a reading at most
``timeout_s`` (default 2 s); once a device's call has been in flight longer than that, requests
answer at once with ``nvml_timeout`` instead of waiting again. When the call finally returns,
the next request samples afresh: the service recovers without a restart. Readings carry
``sampled_at`` (wall clock) and their age; one younger than ``max_age_s`` is reused.

Example::

    monitor = GpuMonitor(default_nvml(), timeout_s=2.0)
    reading = await monitor.reading_for_cuda_index(0)   # DeviceUnavailableError: 503
    reading.gpu.memory.total_memory_bytes, reading.age_seconds()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from autobatch.device import REASONS, UNKNOWN_MEMORY, GpuInfo, Nvml, NvmlDevice, VisibleDevices
from autobatch.errors import DeviceUnavailableError
from service.web.wording import describe

__all__ = ["HEALTH_FAILURES", "GpuMonitor", "Inventory", "Reading"]

T = TypeVar("T")

HEALTH_FAILURES = frozenset({"nvml_timeout", "gpu_lost"})
"""Reasons that make a GPU unusable now: plans for it answer 503 and ``/readyz`` says so."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Reading:
    """One GPU's memory as sampled by its worker."""

    gpu: GpuInfo
    sampled_at: float
    """Unix time of the sample, in seconds."""
    monotonic_s: float
    """``time.monotonic()`` of the sample, for its age."""

    def age_seconds(self, now_s: float | None = None) -> float:
        """Seconds since the sample (``now_s`` is a ``time.monotonic()`` value)."""
        return max(0.0, (time.monotonic() if now_s is None else now_s) - self.monotonic_s)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Inventory:
    """The node's GPUs and the device set the container was given."""

    devices: tuple[NvmlDevice, ...]
    visible: VisibleDevices
    monotonic_s: float


class _Worker:
    """A daemon thread running one call at a time; a call in flight is shared, not repeated.

    Daemon, not a ``ThreadPoolExecutor``: the executor's threads are joined at interpreter exit,
    so a call hung in the driver would keep the process from ever stopping.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        self._in_flight: concurrent.futures.Future[Any] | None = None
        self._started_s = 0.0
        self._thread: threading.Thread | None = None

    def call(self, function: Callable[[], T]) -> tuple[concurrent.futures.Future[T], float]:
        """The future of ``function()`` (or of the call already in flight), and when it started
        (``time.monotonic()``)."""
        with self._lock:
            if self._in_flight is not None and not self._in_flight.done():
                return self._in_flight, self._started_s
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            self._in_flight, self._started_s = future, time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._calls.put((function, future))
            return future, self._started_s

    def _loop(self) -> None:
        while True:
            function, future = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = function()
            except BaseException as exc:  # handed to the waiting requests
                future.set_exception(exc)
            else:
                future.set_result(result)


def _timeout_error(what: str, in_flight_s: float) -> DeviceUnavailableError:
    return DeviceUnavailableError(
        f"NVML did not answer within the timeout while reading {what} (a call has been in "
        f"flight for {in_flight_s:.1f} s); {REASONS['nvml_timeout']}",
        reason="nvml_timeout",
    )


class GpuMonitor:
    """NVML off the event loop: worker threads, timeouts, cached readings.

    Args:
        nvml: the NVML to read (tests pass one over a fake pynvml).
        timeout_s: the longest a request waits for NVML, in seconds.
        max_age_s: a reading younger than this is reused, in seconds.
        inventory_max_age_s: how long the device listing is reused, in seconds.
    """

    def __init__(
        self,
        nvml: Nvml,
        *,
        timeout_s: float = 2.0,
        max_age_s: float = 1.0,
        inventory_max_age_s: float = 30.0,
    ) -> None:
        self.nvml = nvml
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.inventory_max_age_s = inventory_max_age_s
        self._lock = threading.Lock()
        self._inventory_worker = _Worker("autobatch-nvml-devices")
        self._workers: dict[str, _Worker] = {}
        self._inventory: Inventory | None = None
        self._readings: dict[str, Reading] = {}

    async def _await(self, worker: _Worker, function: Callable[[], T], what: str) -> T:
        future, started_s = worker.call(function)
        waited_s = time.monotonic() - started_s
        remaining_s = self.timeout_s - waited_s
        if remaining_s <= 0:  # known hung: answer now, never wait again
            raise _timeout_error(what, waited_s)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), remaining_s)
        except TimeoutError:
            raise _timeout_error(what, time.monotonic() - started_s) from None

    async def inventory(self) -> Inventory:
        """The device listing (no memory), reused for ``inventory_max_age_s``.

        Raises:
            DeviceUnavailableError: no usable NVML (its ``reason`` says why), or the listing
                timed out (``nvml_timeout``).
        """
        cached = self._inventory
        if cached is not None and time.monotonic() - cached.monotonic_s < self.inventory_max_age_s:
            return cached

        def scan() -> Inventory:
            devices, visible = self.nvml.visible()
            return Inventory(devices=tuple(devices), visible=visible, monotonic_s=time.monotonic())

        fresh = await self._await(self._inventory_worker, scan, "the GPU list")
        self._inventory = fresh
        return fresh

    def _worker(self, uuid: str) -> _Worker:
        with self._lock:
            worker = self._workers.get(uuid)
            if worker is None:
                worker = self._workers[uuid] = _Worker(f"autobatch-nvml-{uuid[:12]}")
            return worker

    async def reading(self, device: NvmlDevice) -> Reading:
        """``device``'s memory, sampled within ``max_age_s``.

        Raises:
            DeviceUnavailableError: ``nvml_timeout`` (no answer within ``timeout_s``) or
                ``gpu_lost`` (the GPU fell off the bus), or another NVML failure.
        """
        cached = self._readings.get(device.uuid)
        now_s = time.monotonic()
        if cached is not None and now_s - cached.monotonic_s < self.max_age_s:
            return cached

        def sample() -> Reading:
            gpu = self.nvml.read(device)
            return Reading(gpu=gpu, sampled_at=time.time(), monotonic_s=time.monotonic())

        fresh = await self._await(
            self._worker(device.uuid), sample, f"the memory of GPU {device.uuid}"
        )
        self._readings[device.uuid] = fresh
        return fresh

    async def snapshot(self) -> tuple[Inventory, list[Reading]]:
        """Every GPU with its memory, read concurrently; a GPU that cannot be read (timeout,
        lost) is in the list with unknown memory and the reason: it never hides the others.

        Raises:
            DeviceUnavailableError: no usable NVML, or the listing itself timed out.
        """
        found = await self.inventory()
        results = await asyncio.gather(
            *(self.reading(device) for device in found.devices), return_exceptions=True
        )
        readings: list[Reading] = []
        for device, result in zip(found.devices, results, strict=True):
            if isinstance(result, Reading):
                readings.append(result)
            elif isinstance(result, DeviceUnavailableError):
                readings.append(_failed(device, result))
            else:
                raise result
        return found, readings

    async def reading_for(
        self, *, cuda_index: int | None = None, uuid: str | None = None
    ) -> tuple[Reading | None, Inventory]:
        """The reading of the given device with this ``cuda_index`` or ``uuid`` (None when the
        node has no such device, or it was not given to this container), and the inventory.

        Raises:
            DeviceUnavailableError: as :meth:`inventory` and :meth:`reading`.
        """
        found = await self.inventory()
        for device in found.devices:
            if (cuda_index is not None and device.cuda_index == cuda_index) or (
                uuid is not None and device.uuid == uuid and device.given
            ):
                return await self.reading(device), found
        return None, found


def _failed(device: NvmlDevice, exc: DeviceUnavailableError) -> Reading:
    gpu = device.info(UNKNOWN_MEMORY, reason=exc.reason, detail=describe(exc))
    return Reading(gpu=gpu, sampled_at=time.time(), monotonic_s=time.monotonic())
