"""A node sidecar's read-through to the central service: a profile another node measured
answers here too.

A node's sidecar keeps its own store, and publishes what it measures to the central service
(:mod:`service.fleet.publisher`). When a plan here names a model the node's store does not hold,
and ``AUTOBATCH_CENTRAL_URL`` is set, the sidecar reads what the central service's own plan
draws from: each node's latest profile of that model per thing it measured
(``GET /v1/profiles?latest_per_node=true``: one request, a model and a count, no plan), so a node
that floods central with profiles of the model still holds one voice there. The sidecar draws
among them by the same selection as central (:mod:`service.plans.limits`), keeps a copy of the
chosen one in its own store and plans from it. The copy keeps its node name, so a plan from it
still says where it was measured.

A central service that does not answer in ``timeout_seconds`` (or answers a problem) is not an
error here: the sidecar answers from what it holds, as it would without a central service.
Called in the store's worker thread (``service.web.store_calls``), never on the event loop.

The same reader gives the central service's deletions (:meth:`CentralProfiles.deletions_after`),
which the node follows to delete its copies (``service.fleet.forgetting``).

Example::

    central = CentralProfiles("http://autobatch-central:8000", token=None)
    found = central.latest_per_node("9f2c...", limit=1000)   # [(id, Profile)], newest first
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from autobatch.client import AutobatchClient
from autobatch.errors import AutobatchError
from autobatch.profile import Profile

__all__ = ["CentralProfiles"]

_log = logging.getLogger("service.fleet.central")


class CentralProfiles:
    """Reads profiles from the central service at ``url``.

    Args:
        url: the central service's base URL.
        token: its bearer token, or a function giving it for each request (a rotating file's),
            or None.
        timeout_seconds: the longest a request may take, in seconds.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | Callable[[], str | None] | None,
        timeout_seconds: float = 2.0,
    ) -> None:
        self.url = url
        self._token = token if callable(token) else (lambda: token)
        self.timeout_seconds = timeout_seconds

    def deletions_after(self, cursor: int, *, limit: int) -> tuple[list[str], int]:
        """The ids of profiles the central service deleted after ``cursor``, oldest first, at
        most ``limit``, and the cursor to ask with next.

        Raises:
            AutobatchError: the central service did not answer, or answered a problem.
        """
        with self._client() as client:
            return client.list_deletions(after=cursor, limit=limit)

    def _client(self) -> AutobatchClient:
        return AutobatchClient(self.url, token=self._token(), timeout=self.timeout_seconds)

    def latest_per_node(self, model_fingerprint: str, *, limit: int) -> list[tuple[str, Profile]]:
        """Each node's latest profile of ``model_fingerprint`` per thing it measured at the
        central service (its ``ProfileStore.latest_per_node``), at most ``limit``, as
        ``(profile_id, profile)`` newest first; empty when it holds none or cannot be reached
        (logged)."""
        try:
            with self._client() as client:
                return client.list_profiles(
                    model_fingerprint=model_fingerprint, limit=limit, latest_per_node=True
                )
        except AutobatchError as exc:
            _log.warning(
                "the central service %s gave no profile of %s: %s", self.url, model_fingerprint, exc
            )
            return []
