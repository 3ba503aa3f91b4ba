"""Store calls off the event loop, with a deadline.

A store call may wait: on another process's SQLite write lock (up to the store's busy timeout),
on a PostgreSQL server that is slow or gone. Run on the event loop, such a wait freezes every
request, ``/healthz`` included. :func:`store_call` runs the call in a worker thread and answers
503 ``store-busy`` once ``Settings.store_timeout_seconds`` have passed; the thread is abandoned
(it finishes, or fails, on its own) and the event loop never waits for it.

Example::

    profile = await store_call(state, state.store.get, profile_id)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
from anyio import to_thread

from service.problems import Problem

if TYPE_CHECKING:
    from service.deps import ServiceState

__all__ = ["store_call"]

T = TypeVar("T")


async def store_call(state: ServiceState, function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` in a worker thread, given at most ``store_timeout_seconds``.

    Raises:
        Problem: 503 ``store-busy`` when the call has not returned in time.
        StoreError: whatever the call raised (the service's handler answers 503).
    """
    timeout = state.settings.store_timeout_seconds
    call = functools.partial(function, *args)
    with anyio.move_on_after(timeout) as scope:
        return await to_thread.run_sync(call, abandon_on_cancel=True)
    assert scope.cancelled_caught
    raise Problem(
        503,
        "store-busy",
        f"the profile store did not answer within {timeout:g} s (store_timeout_seconds): "
        "another process may hold its write lock, or its database server is slow; retry later",
    )
