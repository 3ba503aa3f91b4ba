"""What the central service forgets, a node forgets: its copies of deleted profiles go too.

A node sidecar keeps copies of central profiles it planned from (``service.fleet.central``),
and its own measured profiles, which it also published. When an admin deletes a profile at
the central service, the central store leaves a tombstone (``autobatch.store._deletions``).
This thread of the sidecar follows them: every ``interval_seconds`` (10 s by default) it asks
``GET /v1/profile-deletions?after=CURSOR`` (pages of up to 1000, until one is short) and
deletes those ids from the node's store, so a plan here no longer answers from them (nor asks
central for them, which answers 404 too). The ids the node does not hold are tombstoned too, so
a copy fetched from central before the deletion and stored after this pass is refused by the
node's store (``ProfileDeletedError``) instead of staying for good. A deletion at central
therefore leaves the node within ``interval_seconds`` plus one request's timeout (2 s): 12 s by
default, 30 s at most while the interval is at most 28 s. A central service that does not
answer is logged (once per distinct error) and asked again at the next look; the cursor stays
where it was.

The cursor lives in memory: after a restart the node reads the tombstones from the first again
(a few dozen bytes each) and deletes what it still holds of them.

Example::

    forgetting = Forgetting(CentralProfiles(url, token=None), store, interval_seconds=10.0)
    forgetting.open()              # background thread; forgetting.close() stops it
    forgetting.follow_once()       # or one look, now: the ids deleted here
"""

from __future__ import annotations

import logging
import threading

from autobatch.errors import AutobatchError
from autobatch.store import ProfileStore
from service.fleet.central import CentralProfiles

__all__ = ["DEFAULT_INTERVAL_SECONDS", "Forgetting"]

DEFAULT_INTERVAL_SECONDS = 10.0
"""Seconds between two looks at the central service's deletions."""
_PAGE = 1000

_log = logging.getLogger("service.fleet.forgetting")


class Forgetting:
    """Follows ``central``'s deletions into ``store``; see the module docstring.

    Args:
        central: the central service.
        store: the node's store.
        interval_seconds: seconds between two looks.
    """

    def __init__(
        self,
        central: CentralProfiles,
        store: ProfileStore,
        *,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        self._central = central
        self._store = store
        self.interval_seconds = interval_seconds
        self.cursor = 0
        """The central service's deletion cursor followed so far."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error = ""

    def open(self) -> None:
        """Start the thread (again after :meth:`close`); it looks at once, then every
        ``interval_seconds``."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._work, name="forgetting", daemon=True)
        self._thread.start()

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Stop the thread, waiting at most ``timeout_seconds`` for a look in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def follow_once(self) -> list[str]:
        """Read the central service's deletions since :attr:`cursor` and delete those ids from
        the node's store; the ids deleted here.

        Raises:
            AutobatchError: the central service did not answer (``ServiceError``...), or the
                node's store could not be written (``StoreError``); the cursor stays at the
                last page applied.
        """
        removed: list[str] = []
        while True:
            ids, next_after = self._central.deletions_after(self.cursor, limit=_PAGE)
            if ids:
                removed += self._store.forget(ids, absent_too=True)
            self.cursor = next_after
            if len(ids) < _PAGE:
                break
        if removed:
            _log.info(
                "deleted %d profiles that the central service %s deleted: %s",
                len(removed),
                self._central.url,
                ", ".join(removed[:20]) + (" ..." if len(removed) > 20 else ""),
            )
        return removed

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                self.follow_once()
                self._last_error = ""
            except AutobatchError as exc:
                if str(exc) != self._last_error:
                    _log.warning(
                        "could not follow the central service's deletions (%s); trying again "
                        "in %.0f s",
                        exc,
                        self.interval_seconds,
                    )
                    self._last_error = str(exc)
            self._stop.wait(self.interval_seconds)
