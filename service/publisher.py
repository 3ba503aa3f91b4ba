"""A node sidecar's publisher: each profile its probe jobs find is POSTed to the central service.

Set ``AUTOBATCH_CENTRAL_URL`` (``--central-url``) on a node's sidecar and every succeeded probe
job's profile goes to that service's ``/v1/profiles`` from one background thread, retried with
backoff (:func:`autobatch.client.publish_profile`), so neither a probe worker nor a request ever
waits on the network. A profile the central service never takes is logged, counted
(``autobatch_profiles_published_total{outcome="failed"}``), and stays in the node's own store.

Example::

    publisher = Publisher("http://autobatch-central:8000", token=None)
    publisher.submit(profile)      # returns at once
    publisher.close()              # waits a little for what is queued
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from autobatch.client import RetryPolicy, publish_profile
from autobatch.errors import AutobatchError
from autobatch.profile import Profile

__all__ = ["Publisher"]

_log = logging.getLogger("service.publisher")


class Publisher:
    """Publishes profiles to ``url`` in order, one at a time, off the caller's thread.

    Args:
        url: the central service's base URL.
        token: its bearer token, or None.
        policy: retries per profile (default :class:`RetryPolicy()`: 6 tries in 60 s).
        on_outcome: called with ``"published"`` or ``"failed"`` after each profile (metrics).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        policy: RetryPolicy | None = None,
        on_outcome: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url
        self._token = token
        self._policy = policy or RetryPolicy()
        self._on_outcome = on_outcome or (lambda _outcome: None)
        self._queue: queue.Queue[Profile | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="publisher", daemon=True)
        self._thread.start()

    def submit(self, profile: Profile) -> None:
        """Queue ``profile`` for publishing; returns at once."""
        self._queue.put(profile)

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Stop after what is queued, waiting at most ``timeout_seconds``; what is left is
        abandoned (it is in the node's store)."""
        self._queue.put(None)
        self._thread.join(timeout_seconds)

    def _work(self) -> None:
        while (profile := self._queue.get()) is not None:
            try:
                profile_id = publish_profile(
                    self.url, profile, token=self._token, policy=self._policy
                )
            except AutobatchError as exc:
                _log.warning(
                    "could not publish the profile of model %s on %s to %s: %s",
                    profile.model_fingerprint,
                    profile.device_name,
                    self.url,
                    exc,
                )
                self._on_outcome("failed")
            else:
                _log.info("published profile %s to %s", profile_id, self.url)
                self._on_outcome("published")
