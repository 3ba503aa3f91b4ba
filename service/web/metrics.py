"""Prometheus metrics of one app: requests and latency, probe runs, OOMs, GPU memory.

Each app has its own registry (several apps may live in one process, as in tests). GPU memory
gauges are read from NVML at scrape time; without NVML they are simply absent.

Example::

    metrics = Metrics()
    metrics.observe_request("POST", "/v1/plan", 200, 0.004)
    text = metrics.render(list_gpus)       # the /metrics body
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from autobatch.device import GpuInfo
from autobatch.errors import DeviceUnavailableError

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _GpuCollector(Collector):
    def __init__(self) -> None:
        self.list_gpus: Callable[[], list[GpuInfo]] = list

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            gpus = self.list_gpus()
        except DeviceUnavailableError:
            return
        labels = ["uuid", "name", "nvml_index"]
        families = {
            "total": GaugeMetricFamily(
                "autobatch_gpu_memory_total_bytes", "GPU total memory (NVML)", labels=labels
            ),
            "free": GaugeMetricFamily(
                "autobatch_gpu_memory_free_bytes", "GPU free memory (NVML)", labels=labels
            ),
            "used": GaugeMetricFamily(
                "autobatch_gpu_memory_used_bytes", "GPU used memory (NVML)", labels=labels
            ),
        }
        for gpu in gpus:
            values = [gpu.uuid, gpu.name, str(gpu.nvml_index)]
            memory = gpu.memory
            for key, value in (
                ("total", memory.total_memory_bytes),
                ("free", memory.free_memory_bytes),
                ("used", memory.used_memory_bytes),
            ):
                if value is not None:  # unknown memory is no sample, never a 0
                    families[key].add_metric(values, value)
        yield from families.values()


class Metrics:
    """The app's metrics.

    GPU gauges come from the ``list_gpus`` given to :meth:`render`, called at each scrape.
    """

    def __init__(self) -> None:
        self._render_lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "autobatch_http_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "autobatch_http_request_duration_seconds",
            "HTTP request latency in seconds by method and route template",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.probe_events = Counter(
            "autobatch_probe_jobs",
            "Probe runs by event: started, succeeded, failed",
            ["event"],
            registry=self.registry,
        )
        self.ooms = Counter(
            "autobatch_probe_ooms",
            "Out-of-memory trials caught by probe runs",
            registry=self.registry,
        )
        self.published = Counter(
            "autobatch_profiles_published",
            "Profiles a node's sidecar published to the central service, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.outbox_waiting = Gauge(
            "autobatch_outbox_waiting_profiles",
            "Profiles in a node's outbox, waiting for the central service to acknowledge them",
            registry=self.registry,
        )
        self.outbox_dropped = Counter(
            "autobatch_outbox_dropped_profiles",
            "Profiles taken out of a node's outbox unsent, by reason: full (the oldest, beyond "
            "its bound), missing (deleted from the node's store)",
            ["reason"],
            registry=self.registry,
        )
        self._request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        for event in ("started", "succeeded", "failed"):
            self.probe_events.labels(event)
        self._gpus = _GpuCollector()
        self.registry.register(self._gpus)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one request and its latency (``route`` is the template, e.g. ``/v1/plan``)."""
        key = (method, route, status)
        children = self._request_children.get(key)
        if children is None:  # labels() takes a lock and builds a key: once per label set
            children = (
                self.requests.labels(method, route, str(status)),
                self.latency.labels(method, route),
            )
            self._request_children[key] = children
        count, latency = children
        count.inc()
        latency.observe(seconds)

    def probe_event(self, event: str) -> None:
        """``"started"``, ``"succeeded"``, ``"failed"``, or ``"oom"`` (one caught OOM)."""
        if event == "oom":
            self.ooms.inc()
        else:
            self.probe_events.labels(event).inc()

    def publish_outcome(self, outcome: str) -> None:
        """One try of a node's publisher: ``"published"`` (acknowledged), ``"retried"`` (not
        acknowledged: tried again later) or ``"refused"`` (refused for good: out of the outbox)."""
        self.published.labels(outcome).inc()

    def render(self, list_gpus: Callable[[], list[GpuInfo]]) -> bytes:
        """The Prometheus text exposition of every metric, GPU memory read with ``list_gpus``."""
        with self._render_lock:
            self._gpus.list_gpus = list_gpus
            return generate_latest(self.registry)
