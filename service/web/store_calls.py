"""Store calls off the event loop, on threads of their own, with a deadline.

A store call may wait: on another process's SQLite write lock, on a PostgreSQL table lock, on a
database server that is slow, frozen or gone. Run on the event loop, such a wait freezes every
request, ``/healthz`` included; run on the thread pool the event loop lends to synchronous
routes, a few stuck calls take the threads every other route needs. :class:`StoreCalls` runs
store calls on a small pool of daemon threads of their own (``STORE_THREADS``) and answers 503
``store-busy`` once ``Settings.store_timeout_seconds`` have passed. A call still queued at its
deadline never runs; one already running is left to finish on its own, which the store bounds
too: it opens with the same timeout, so the database gives up on the statement or lock then
(``autobatch.store._engine``). However many requests wait on a stuck store, it holds at most
``STORE_THREADS`` threads and the event loop never waits for any.

Example::

    profile = await store_call(state, state.store.get, profile_id)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import anyio

from service.web.problems import Problem

__all__ = ["STORE_THREADS", "HasStoreCalls", "StoreCalls", "store_busy", "store_call"]

T = TypeVar("T")

STORE_THREADS = 8
"""Threads that run store calls, per service: fewer than a PostgreSQL store's pool holds
(``autobatch.store._engine``), so that requests never wait on the pool itself and probe runs
writing their profiles still find a connection; calls beyond them queue, within their deadline."""

_Work = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class StoreCalls:
    """A bounded pool of daemon threads for store calls, each given a deadline.

    Daemon threads, unlike ``concurrent.futures.ThreadPoolExecutor``'s: a call stuck on a
    frozen database server never holds the process at exit.

    Args:
        timeout_seconds: the deadline of each call, in seconds (``store_timeout_seconds``).
        max_threads: threads at most, started as calls need them.
    """

    def __init__(self, *, timeout_seconds: float, max_threads: int = STORE_THREADS) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_threads = max_threads
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    async def __call__(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on a store thread, given at most ``timeout_seconds``.

        Raises:
            Problem: 503 ``store-busy`` when the call has not returned in time.
            StoreError: whatever the call raised (the service's handler answers 503).
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit((future, functools.partial(function, *args)))
        with anyio.move_on_after(self.timeout_seconds):
            # Cancelled at the deadline, the wrapper cancels the call too if it is still queued.
            return await asyncio.wrap_future(future)
        raise store_busy(self.timeout_seconds)

    def close(self) -> None:
        """Stop the threads once they finish the calls queued before; a later call starts
        threads anew (an app whose lifespan ends and begins again). Idempotent."""
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            self._threads = []

    def _submit(self, work: _Work) -> None:
        with self._lock:
            self._queue.put(work)
            if len(self._threads) < self.max_threads:  # started as load grows, then kept
                thread = threading.Thread(target=self._work, name="store-call", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _work(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            future, call = work
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                    future.set_exception(exc)


def store_busy(timeout_seconds: float) -> Problem:
    """503 ``store-busy``: the store did not answer within its deadline."""
    return Problem(
        503,
        "store-busy",
        f"the profile store did not answer within {timeout_seconds:g} s "
        "(store_timeout_seconds): another process may hold its write lock, or its database "
        "server is slow; retry later",
    )


class HasStoreCalls(Protocol):
    """What :func:`store_call` needs of the app's state (``service.deps.ServiceState``)."""

    @property
    def store_calls(self) -> StoreCalls: ...


async def store_call(state: HasStoreCalls, function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` on the service's store threads (``state.store_calls``), given at
    most ``store_timeout_seconds``.

    Raises:
        Problem: 503 ``store-busy`` when the call has not returned in time.
        StoreError: whatever the call raised (the service's handler answers 503).
    """
    return await state.store_calls(function, *args)
