"""Probe runs: each tunes a registered model in its own child process, through the library's
one road (:func:`autobatch.tuning.autotune_profile`): a stored profile that still answers is the
result, unless the run asks for ``refresh``; otherwise the child probes and stores the profile.

Scheduling, per GPU (``"cuda:0"``) and one for the host (``cpu`` and every ``sim:SIZE``, see
:func:`queue_key`): one run at a time; later runs wait in a first-in, first-out queue of at
most ``max_queued`` runs, and a submission beyond that raises :class:`QueueFullError` (HTTP
409). Runs on different GPUs run in parallel.

A run's child is started with the ``spawn`` method (no state inherited from the server; torch is
imported there, never in the server), reports each trial through a queue, and sends back the
profile with its id in the store (the child writes the store's file, which SQLite lets processes
share; the server stores what the child did not). A child that exceeds the timeout is killed; a
child that crashes or is killed from outside marks its run failed; the server carries on with the
next run. A child dies with the server, even one killed by SIGKILL (``service.probes.children``).

Example::

    runs = ProbeRuns(registry, store, timeout_seconds=600, max_queued=8)
    run = runs.submit("tiny-mlp")
    runs.get(run.id).status          # "queued", "running", "succeeded" or "failed"
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import importlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from autobatch.device import cuda_visible_devices, default_nvml, resolve_device
from autobatch.errors import ConfigError, DeviceUnavailableError, StoreError
from autobatch.profile import Profile
from autobatch.store import ProfileStore
from service.probes.children import die_with_parent, kill_group
from service.probes.registry import ModelEntry, Registry, cuda_index
from service.web.wording import describe

__all__ = [
    "ProbeRun",
    "ProbeRunStatus",
    "ProbeRuns",
    "QueueFullError",
    "UnknownModelError",
    "UnknownProbeRunError",
]

_log = logging.getLogger("service.probes.runs")

ProbeRunStatus = Literal["queued", "running", "succeeded", "failed"]
_POLL_SECONDS = 0.1
_MAX_FINISHED_JOBS = 1000


class UnknownModelError(LookupError):
    """The model name is not in the server's registry."""


class UnknownProbeRunError(LookupError):
    """No run has this id."""


class QueueFullError(RuntimeError):
    """The device's queue already holds ``max_queued`` waiting runs."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeRun:
    """A snapshot of one probe run."""

    id: str
    model: str
    device: str
    status: ProbeRunStatus
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    queue_position: int | None = None
    """Runs ahead of this one on its device while queued (0: next); None otherwise."""
    child_pid: int | None = None
    """The child process's pid while running (kill it to abort the run)."""
    num_trials: int = 0
    num_ooms: int = 0
    largest_fitting_micro_batch_size: int = 0
    last_trial: dict[str, Any] | None = None
    refresh: bool = False
    """Probe even when the store has a profile that answers."""
    cached: bool = False
    """True when the run answered from the store (no step ran)."""
    profile_id: str | None = None
    profile: dict[str, Any] | None = None
    error: str = ""


class ProbeRuns:
    """Queues, runs and remembers probe runs; thread-safe.

    Args:
        registry: the models that may be probed.
        store: where resulting profiles are kept.
        timeout_seconds: wall time after which a running child is killed, seconds.
        max_queued: waiting runs allowed per device.
        on_event: called with ``"started"``, ``"failed"``, ``"succeeded"`` or ``"oom"`` (metrics).
        on_profile: called with each succeeded run's profile before the run reads as succeeded
            (a node's publisher queues it in its outbox); a StoreError it raises is logged.
    """

    def __init__(
        self,
        registry: Registry,
        store: ProfileStore,
        *,
        timeout_seconds: float,
        max_queued: int,
        on_event: Callable[[str], None] | None = None,
        on_profile: Callable[[Profile], None] | None = None,
    ) -> None:
        self.registry = registry
        self._store = store
        self._timeout_seconds = timeout_seconds
        self._max_queued = max_queued
        self._on_event = on_event or (lambda _event: None)
        self._on_profile = on_profile or (lambda _profile: None)
        self._lock = threading.Condition()
        self._runs: dict[str, ProbeRun] = {}
        self._queues: dict[str, collections.deque[str]] = {}
        self._workers: dict[str, threading.Thread] = {}
        self._children: dict[str, multiprocessing.process.BaseProcess] = {}
        self._closed = False
        self._context = multiprocessing.get_context("spawn")
        self._records: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._recorder: threading.Thread | None = None

    def submit(self, model: str, *, device: str | None = None, refresh: bool = False) -> ProbeRun:
        """Queue a probe of the registered ``model`` on ``device`` (default: the entry's).

        A stored profile of the same model, input and device that still answers (see
        :func:`autobatch.tuning.autotune_profile`) is the run's result, without a step, unless
        ``refresh``.

        Raises:
            UnknownModelError: ``model`` is not registered.
            QueueFullError: the device already has ``max_queued`` runs waiting.
        """
        entry = self.registry.models.get(model)
        if entry is None:
            known = (
                ", ".join(sorted(self.registry.models))
                or "none: the server was started without --config-file (AUTOBATCH_CONFIG_FILE)"
            )
            raise UnknownModelError(f"model {model!r} is not registered (known: {known})")
        target = device or entry.device
        key = queue_key(target)
        with self._lock:
            if self._closed:
                raise QueueFullError("the server is shutting down")
            waiting = self._queues.setdefault(key, collections.deque())
            if len(waiting) >= self._max_queued:
                raise QueueFullError(
                    f"{len(waiting)} probe run(s) already wait for {key} (the limit); retry "
                    "when one finishes"
                )
            run = ProbeRun(
                id=uuid.uuid4().hex[:16],
                model=model,
                device=target,
                status="queued",
                created_at=_now(),
                refresh=refresh,
            )
            self._runs[run.id] = run
            self._record(run.id)
            waiting.append(run.id)
            self._forget_old()
            worker = self._workers.get(key)
            if worker is None or not worker.is_alive():
                worker = threading.Thread(
                    target=self._work, args=(key,), name=f"probe-{key}", daemon=True
                )
                self._workers[key] = worker
                worker.start()
            self._lock.notify_all()
            return self._snapshot(run.id)

    def get(self, run_id: str) -> ProbeRun:
        """The run's current state; a run from before the server restarted is read
        from the store, and one it left unfinished reads as failed.

        Raises:
            UnknownProbeRunError: no run has this id (or it finished long ago and was forgotten).
            StoreError: the store cannot be read.
        """
        with self._lock:
            if run_id in self._runs:
                return self._snapshot(run_id)
        record = self._store.get_probe_run(run_id)
        if record is None:
            raise UnknownProbeRunError(f"no probe run with id {run_id!r}")
        fields = {k: v for k, v in record.items() if k in ProbeRun.__dataclass_fields__}
        run = ProbeRun(**{**fields, "queue_position": None, "child_pid": None})
        if run.status in ("queued", "running"):
            run = dataclasses.replace(
                run,
                status="failed",
                error=f"the server restarted while the run was {run.status}; submit it again",
            )
        return run

    def list_runs(self) -> list[ProbeRun]:
        """Every remembered run, newest first."""
        with self._lock:
            return [self._snapshot(run_id) for run_id in reversed(self._runs)]

    def open(self) -> None:
        """Accept runs again after :meth:`close` (an app's lifespan may run more than once)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Kill running children and stop the workers (queued runs are marked failed)."""
        with self._lock:
            self._closed = True
            children = list(self._children.values())
            for waiting in self._queues.values():
                for run_id in waiting:
                    self._update(
                        run_id, status="failed", error="the server shut down", finished_at=_now()
                    )
                waiting.clear()
            self._lock.notify_all()
        for child in children:
            kill_group(child)
        for worker in list(self._workers.values()):
            worker.join(timeout=10)
        recorder = self._recorder
        if recorder is not None:
            self._records.put(None)  # written what was recorded, then stop
            recorder.join(timeout=10)

    # -- internals ---------------------------------------------------------------------------

    def _snapshot(self, run_id: str) -> ProbeRun:
        run = self._runs[run_id]
        if run.status == "queued":
            waiting = self._queues.get(queue_key(run.device), collections.deque())
            position = list(waiting).index(run_id) if run_id in waiting else 0
            return dataclasses.replace(run, queue_position=position)
        return run

    def _update(self, run_id: str, **changes: Any) -> None:
        self._runs[run_id] = dataclasses.replace(self._runs[run_id], **changes)
        if "status" in changes:
            self._record(run_id)

    def _record(self, run_id: str) -> None:
        """Hand the run's state to the recorder thread, which keeps it in the store (so a
        restarted server still answers the id); never waits on the store (the caller may be
        on the event loop, and holds the lock)."""
        self._records.put(dataclasses.asdict(self._runs[run_id]))
        if self._recorder is None or not self._recorder.is_alive():
            self._recorder = threading.Thread(
                target=self._write_records, name="probe-run-records", daemon=True
            )
            self._recorder.start()

    def _write_records(self) -> None:
        while (record := self._records.get()) is not None:
            try:
                self._store.put_probe_run(record["id"], record)
            except StoreError as exc:  # the run runs on; only a restart would lose it
                _log.warning("probe run %s not recorded in the store: %s", record["id"], exc)

    def _forget_old(self) -> None:
        finished = [j for j, run in self._runs.items() if run.status in ("succeeded", "failed")]
        for run_id in finished[: max(0, len(finished) - _MAX_FINISHED_JOBS)]:
            del self._runs[run_id]

    def _work(self, key: str) -> None:
        while True:
            with self._lock:
                waiting = self._queues[key]
                while not waiting and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                run_id = waiting.popleft()
                run = self._runs[run_id]
                entry = self.registry.models[run.model]
            try:
                self._run(run_id, entry, run.device, run.refresh)
            except Exception as exc:  # a bug here must not stop the device's queue
                with self._lock:
                    self._update(
                        run_id,
                        status="failed",
                        finished_at=_now(),
                        error=f"internal error: {type(exc).__name__}: {exc}",
                    )
                self._on_event("failed")

    def _store_path(self) -> str | None:
        """The store's location for the child (a file or a URL); None for an in-memory store
        (the child cannot share it: each run then probes, and the parent stores the result)."""
        return self._store.shared_location()

    def _run(self, run_id: str, entry: ModelEntry, device: str, refresh: bool) -> None:
        messages = self._context.Queue()
        child = self._context.Process(
            target=_child_main,
            args=(entry.model_dump(), device, self._store_path(), refresh, messages, os.getpid()),
            name=f"autobatch-probe-{run_id}",
            daemon=True,
        )
        with self._lock:
            if self._closed:
                self._update(
                    run_id, status="failed", error="the server shut down", finished_at=_now()
                )
                return
            child.start()
            self._children[run_id] = child
            # "running" and the pid appear together: a client that sees one can use the other.
            self._update(run_id, status="running", started_at=_now(), child_pid=child.pid)
        self._on_event("started")
        deadline = time.monotonic() + self._timeout_seconds
        outcome: tuple[str, Any] | None = None
        try:
            while outcome is None:
                try:
                    kind, payload = messages.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    if not child.is_alive():
                        outcome = self._drain(messages) or ("died", None)
                    elif time.monotonic() > deadline:
                        kill_group(child)
                        outcome = (
                            "error",
                            f"timed out after {self._timeout_seconds:g} s; the "
                            "probe's child process was killed",
                        )
                    continue
                except Exception as exc:  # a child killed mid-message leaves a torn pickle
                    outcome = ("error", f"lost the child's report: {type(exc).__name__}: {exc}")
                    continue
                if kind == "trial":
                    self._record_trial(run_id, payload)
                else:
                    outcome = (kind, payload)
            child.join(timeout=10)
            if child.is_alive():
                kill_group(child)
                child.join(timeout=10)
        finally:
            with self._lock:
                self._children.pop(run_id, None)
            messages.close()
        self._finish(run_id, outcome, child.exitcode)

    @staticmethod
    def _drain(messages: Any) -> tuple[str, Any] | None:
        try:
            while True:
                kind, payload = messages.get(timeout=_POLL_SECONDS)
                if kind != "trial":
                    return kind, payload
        except Exception:
            return None

    def _record_trial(self, run_id: str, trial: dict[str, Any]) -> None:
        if trial.get("oom"):
            self._on_event("oom")
        with self._lock:
            run = self._runs[run_id]
            largest = run.largest_fitting_micro_batch_size
            if trial.get("fits") and not trial.get("warm_up"):
                largest = max(largest, int(trial["micro_batch_size"]))
            self._update(
                run_id,
                num_trials=run.num_trials + 1,
                num_ooms=run.num_ooms + bool(trial.get("oom")),
                largest_fitting_micro_batch_size=largest,
                last_trial=trial,
            )

    def _finish(self, run_id: str, outcome: tuple[str, Any], exitcode: int | None) -> None:
        kind, payload = outcome
        changes: dict[str, Any] = {"finished_at": _now(), "child_pid": None}
        if kind == "profile":
            try:
                profile = Profile.from_dict(payload["profile"])
                # The road stored it (or found it stored); a profile it does not store (cut
                # short by a non-OOM failure, or an in-memory store) is kept here, so every
                # run's result has an id to plan from.
                changes.update(
                    status="succeeded",
                    profile=profile.to_dict(),
                    cached=bool(payload["cached"]),
                    profile_id=payload["profile_id"] or self._store.put(profile),
                )
            except Exception as exc:
                changes.update(status="failed", error=f"cannot store the profile: {exc}")
        elif kind == "error":
            changes.update(status="failed", error=str(payload))
        else:
            changes.update(status="failed", error=_describe_exit(exitcode))
        if changes["status"] == "succeeded":
            try:
                self._on_profile(profile)
            except StoreError as exc:
                _log.warning("probe run %s: its profile was not queued to publish: %s", run_id, exc)
        with self._lock:
            self._update(run_id, **changes)
            run = self._runs[run_id]
        if run.status == "failed":
            _log.warning(
                "probe run %s (model %r on %s) failed: %s", run_id, run.model, run.device, run.error
            )
        self._on_event("succeeded" if changes["status"] == "succeeded" else "failed")


def queue_key(device: str) -> str:
    """The queue a device's runs wait in: one per CUDA index (``"cuda:01"`` is ``"cuda:1"``),
    and one for the host, shared by ``cpu`` and every ``sim:SIZE`` (they all run on the CPU, and
    two at once would slow each other's trials)."""
    index = cuda_index(device)
    return "host" if index is None else f"cuda:{index}"


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the probe's child process was killed by {name} before it reported a result"
    return f"the probe's child process exited with code {exitcode} before it reported a result"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _child_main(
    entry_data: dict[str, Any],
    device: str,
    store_path: str | None,
    refresh: bool,
    messages: Any,
    parent_pid: int,
) -> None:
    """The child process: build the registered model and sample, tune, report. Imports torch.
    Dies with the server (``parent_pid``), and leads its own process group
    (:func:`service.probes.children.die_with_parent`)."""
    die_with_parent(parent_pid)
    try:
        entry = ModelEntry.model_validate(entry_data)
        messages.put(("profile", _tune(entry, device, store_path, refresh, messages)))
    except Exception as exc:
        text = describe(exc)  # remedies as the service words them
        first_line = text.splitlines()[0] if text else ""
        messages.put(("error", f"{type(exc).__name__}: {first_line}"))
    messages.close()
    messages.join_thread()


def _pin_visible_devices() -> None:
    """Make this child's ``cuda:N`` the service's ``cuda_index`` N: CUDA_VISIBLE_DEVICES set to
    the UUIDs of the device set the container was given, in CUDA's order (a privileged pod's
    CUDA would otherwise number every card on the node). Left alone without NVML."""
    try:
        _devices, resolved = default_nvml().visible()
    except DeviceUnavailableError:
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(resolved)


def _tune(
    entry: ModelEntry, device: str, store_path: str | None, refresh: bool, messages: Any
) -> dict[str, Any]:
    """Through the library's one road (:func:`autobatch.tuning.tune_profile`): a stored
    profile that still answers, unless ``refresh``; else a probe, stored by the road."""
    from autobatch.tuning import TuneRequest, tune_profile  # torch: only the probe child loads it

    if cuda_index(device) is not None:
        _pin_visible_devices()
    target = resolve_device(device)
    spec = _registered_model(entry).to(target.torch_device)
    request = TuneRequest.build(
        spec.model,
        spec.sample,
        loss_fn=spec.loss_fn,
        device=target,
        safety_margin=entry.safety_margin,
        max_micro_batch_size=entry.search_limit,
        use_estimate=entry.use_estimate,
        store=store_path,
        use_store=store_path is not None,
        refresh=refresh,
        on_trial=lambda trial: messages.put(("trial", dataclasses.asdict(trial))),
    )
    found = tune_profile(request)
    return {
        "profile": found.profile.to_dict(),
        "cached": found.cached,
        "profile_id": found.profile_id,
    }


def _registered_model(entry: ModelEntry) -> Any:
    """The entry's model (its factory, seeded) and a random sample of one row, on the CPU."""
    import torch
    import torch.nn.functional as F

    from autobatch.models import ModelSpec  # torch: only the probe child loads it

    module_name, _, function_name = entry.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"cannot load factory {entry.factory!r}: {type(exc).__name__}: {exc} (the server's "
            "working directory and PYTHONPATH are the import path)"
        ) from exc
    torch.manual_seed(0)
    model = factory()
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in entry.inputs.items():
        shape = (1, *spec.shape)
        dtype = getattr(torch, spec.dtype)
        if dtype.is_floating_point:
            tensors[name] = torch.randn(shape, dtype=dtype)
        elif dtype == torch.bool:
            tensors[name] = torch.randint(0, 2, shape).bool()
        else:
            tensors[name] = torch.randint(0, spec.high, shape, dtype=dtype)
    if entry.loss is None:
        return ModelSpec(name=entry.factory, model=model, sample=tensors)
    return ModelSpec(
        name=entry.factory,
        model=model,
        sample=(tensors["input"], tensors["target"]),
        loss_fn=getattr(F, entry.loss),
    )
