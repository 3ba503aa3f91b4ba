"""A node sidecar's publisher: every profile its probe runs store reaches the central service.

Set ``AUTOBATCH_CENTRAL_URL`` (``--central-url``) on a node's sidecar and each succeeded probe
run's profile enters the node's outbox (:mod:`autobatch.store._outbox`, a table of the node's
own store) as the run finishes. One background thread sends what the outbox holds to the central
service's ``/v1/profiles``, oldest due first, until the central service acknowledges it (any 2xx,
or 409: it already holds it), across outages of any length and restarts of either side: the rows
stay in the store, and a sender started again resumes from them.

- **Retries**: after a try that is not acknowledged the sender waits (and the row is not tried
  again before) an exponentially growing delay with full jitter, a uniform draw in
  ``[0, min(max_delay, base_delay * 2**failures)]`` where ``failures`` counts the sender's
  consecutive failures (so an outage slows every row, not only the first), and at least the
  server's ``Retry-After`` (up to an hour).
- **Refusals**: an answer that says the profile itself is wrong (400, 413, 415, 422, and any
  other 4xx but 401, 403, 404, 408, 409, 425, 429) takes it out, logged with the answer; it
  stays in the node's store. So does 410: central deleted that profile (an admin's DELETE
  raced this row's retry) and never stores it again, so it is not resent. 401/403/404 say the
  node's token or URL is wrong, which an operator fixes: those are retried, so nothing is lost
  meanwhile.
- **Bound**: at most ``max_rows`` rows wait; entering one more drops the oldest, logged (which
  profile, since when, how many tries, the last error) and counted.
- **Metrics** (``service.web.metrics``): ``autobatch_outbox_waiting_profiles`` (gauge),
  ``autobatch_profiles_published_total{outcome="published"|"retried"|"refused"}`` and
  ``autobatch_outbox_dropped_profiles_total{reason="full"|"missing"}``.
- **Shutdown** stops the sender; what waits stays in the outbox for the next start.

Example::

    publisher = Publisher("http://autobatch-central:8000", token=None, store=store)
    publisher.open()               # the sender resumes what the outbox holds
    publisher.submit(profile)      # stored (a no-op when it is) and queued; returns at once
    publisher.close()              # stops sending; the outbox keeps what waits
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable

import httpx

from autobatch.client import RETRIED_STATUSES, retry_after_seconds
from autobatch.errors import ConfigError, StoreError
from autobatch.profile import Profile
from autobatch.store import OutboxEntry, ProfileStore
from service.web.metrics import Metrics

__all__ = ["OutboxPolicy", "Publisher"]

_log = logging.getLogger("service.fleet.publisher")

RETRIED_CLIENT_ERRORS = frozenset({401, 403, 404, 408, 425, 429})
"""4xx answers that do not say the profile is wrong: retried, never a reason to drop it."""
_IDLE_SECONDS = 60.0  # the longest the sender sleeps with nothing due (a submit wakes it)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OutboxPolicy:
    """How the sender spaces its tries and how much the outbox holds."""

    base_delay_seconds: float = 1.0
    """The first wait's upper bound after a failure, seconds, > 0; it doubles per failure."""
    max_delay_seconds: float = 60.0
    """No jittered wait is longer than this, seconds (a ``Retry-After`` may be)."""
    max_retry_after_seconds: float = 3600.0
    """A ``Retry-After`` is honoured up to this many seconds."""
    timeout_seconds: float = 10.0
    """Each try's own timeout, seconds."""
    max_rows: int = 10_000
    """Profiles the outbox holds at most; the oldest beyond it are dropped."""

    def __post_init__(self) -> None:
        for name in ("base_delay_seconds", "max_delay_seconds", "timeout_seconds"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} {value!r} must be a number of seconds > 0")
        if isinstance(self.max_rows, bool) or self.max_rows < 1:
            raise ConfigError(f"max_rows {self.max_rows!r} must be an int >= 1")

    def delay_seconds(self, failures: int, draw: float, retry_after: float | None) -> float:
        """The wait after the sender's ``failures``-th consecutive failure (1-based), with
        ``draw`` uniform in [0, 1), and at least ``retry_after`` seconds when the server said
        so (capped at :attr:`max_retry_after_seconds`)."""
        exponent = min(max(failures - 1, 0), 62)
        jittered = draw * min(self.max_delay_seconds, self.base_delay_seconds * 2.0**exponent)
        if retry_after is None:
            return jittered
        return max(jittered, min(retry_after, self.max_retry_after_seconds))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Answer:
    outcome: str
    """``"published"``, ``"retried"`` or ``"refused"``."""
    detail: str
    retry_after: float | None = None


class Publisher:
    """Sends the node's outbox to ``url``, one profile at a time, from one background thread.

    Args:
        url: the central service's base URL.
        token: its bearer token, or a function giving it for each request (a rotating
            file's: ``service.web.auth.central_token_source``), or None.
        store: the node's store (its outbox and its profiles).
        policy: retries and bound (default :class:`OutboxPolicy()`).
        metrics: counts outcomes and what waits; None counts nothing.
        clock: the time, Unix seconds (the outbox's times outlive the process).
        draw: the jitter's uniform draw in [0, 1).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | Callable[[], str | None] | None,
        store: ProfileStore,
        policy: OutboxPolicy | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.url = url
        self._token = token if callable(token) else (lambda: token)
        self._store = store
        self.policy = policy or OutboxPolicy()
        self._metrics = metrics
        self._clock = clock
        self._draw = draw
        self._wake = threading.Event()
        self._stopping = False
        self._failures = 0
        self._not_before = 0.0
        self._last_store_error = ""
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Start the sender (again after :meth:`close`); it resumes what the outbox holds."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="publisher", daemon=True)
        self._thread.start()

    def submit(self, profile: Profile) -> None:
        """Keep ``profile`` in the store (a no-op when it is there) and queue it; returns once
        it is in the outbox. A full outbox drops its oldest rows (logged, counted).

        Raises:
            StoreError: the store could not take it (the caller logs it).
        """
        profile_id = self._store.put(profile)
        dropped = self._store.outbox.enqueue(
            profile_id, now=self._clock(), max_rows=self.policy.max_rows
        )
        for entry in dropped:
            _log.warning(
                "outbox full (%d profiles): dropped profile %s, queued at %s, after %d tries "
                "(last: %s), to queue profile %s; it stays in the node's store",
                self.policy.max_rows,
                entry.profile_id,
                _when(entry.enqueued_at),
                entry.attempts,
                entry.last_error or "none",
                profile_id,
            )
        if self._metrics is not None and dropped:
            self._metrics.outbox_dropped.labels("full").inc(len(dropped))
        self._count_waiting()
        self._wake.set()

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Stop the sender, waiting at most ``timeout_seconds`` for a try in flight; what waits
        stays in the outbox (a try whose answer comes later is simply sent again next time)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _work(self) -> None:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        self._count_waiting()
        with httpx.Client(
            base_url=self.url, headers=headers, timeout=self.policy.timeout_seconds
        ) as http:
            while not self._stopping:
                wait = self._step(http)
                if wait > 0 and not self._stopping:
                    self._wake.wait(wait)
                    self._wake.clear()

    def _step(self, http: httpx.Client) -> float:
        """Send the earliest due row, if any; the seconds to wait before the next step."""
        now = self._clock()
        if now < self._not_before:
            return self._not_before - now
        try:
            entry = self._store.outbox.earliest()
            if entry is None:
                return _IDLE_SECONDS
            if entry.next_attempt_at > now:
                return entry.next_attempt_at - now
            if entry.profile_json is None:
                self._drop_missing(entry)
                return 0.0
            answer = _send(http, entry.profile_json.encode(), self._token())
            self._settle(entry, answer, attempted_at=now)
        except StoreError as exc:
            self._failures += 1
            if str(exc) != self._last_store_error:
                _log.warning("the publisher cannot read or update the outbox: %s", exc)
                self._last_store_error = str(exc)
            return self.policy.delay_seconds(self._failures, self._draw(), None)
        self._last_store_error = ""
        return 0.0

    def _settle(self, entry: OutboxEntry, answer: _Answer, *, attempted_at: float) -> None:
        outbox = self._store.outbox
        if answer.outcome == "retried":
            self._failures += 1
            wait = self.policy.delay_seconds(self._failures, self._draw(), answer.retry_after)
            self._not_before = attempted_at + wait
            outbox.retry_later(
                entry.profile_id,
                attempted_at=attempted_at,
                next_attempt_at=self._not_before,
                error=answer.detail,
            )
            if self._failures == 1 or entry.attempts == 0:
                _log.warning(
                    "could not publish profile %s to %s (%s); retrying in %.1f s, and until "
                    "the central service takes it",
                    entry.profile_id,
                    self.url,
                    answer.detail,
                    wait,
                )
        else:
            self._failures = 0
            outbox.remove(entry.profile_id)
            if answer.outcome == "refused":
                _log.warning(
                    "the central service %s refused profile %s for good (%s): taken out of "
                    "the outbox; it stays in the node's store",
                    self.url,
                    entry.profile_id,
                    answer.detail,
                )
            else:
                _log.info("published profile %s to %s", entry.profile_id, self.url)
            self._count_waiting()
        if self._metrics is not None:
            self._metrics.publish_outcome(answer.outcome)

    def _drop_missing(self, entry: OutboxEntry) -> None:
        self._store.outbox.remove(entry.profile_id)
        _log.warning(
            "dropped profile %s from the outbox: it is no longer in the node's store (deleted)",
            entry.profile_id,
        )
        if self._metrics is not None:
            self._metrics.outbox_dropped.labels("missing").inc()
        self._count_waiting()

    def _count_waiting(self) -> None:
        if self._metrics is None:
            return
        # on a store failure the gauge keeps its last value; the sender logs the failure
        with contextlib.suppress(StoreError):
            self._metrics.outbox_waiting.set(self._store.outbox.count())


def _send(http: httpx.Client, body: bytes, token: str | None) -> _Answer:
    """One POST of ``body`` to ``/v1/profiles`` with ``token``, its answer classified."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = http.post("/v1/profiles", content=body, headers=headers)
    except httpx.HTTPError as exc:
        return _Answer(outcome="retried", detail=f"cannot reach it: {exc!r}")
    status = response.status_code
    detail = f"answered {status} {response.reason_phrase}: {response.text[:200]}"
    if response.is_success or status == 409:
        return _Answer(outcome="published", detail=detail)
    if status in RETRIED_STATUSES or status in RETRIED_CLIENT_ERRORS or status >= 500:
        return _Answer(outcome="retried", detail=detail, retry_after=retry_after_seconds(response))
    return _Answer(outcome="refused", detail=detail)


def _when(unix_seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_seconds))
