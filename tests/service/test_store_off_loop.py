"""The service never waits on the store on its event loop: a store locked by another process
makes ``/readyz`` answer "not ready" at its deadline while ``/healthz`` keeps answering."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI


def test_readyz_says_busy_when_another_process_holds_the_write_lock(
    make_app: Callable[..., FastAPI], tmp_path: Path
) -> None:
    path = tmp_path / "locked.sqlite3"
    app = make_app(store_path=str(path), store_timeout_seconds=0.3)
    app.state.service.store.check_writable()  # the file exists, with its tables
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # as another writer's long transaction would
    try:
        ready, alive = _readyz_beside_healthz(app)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert ready.status_code == 503
    body = ready.json()
    assert body["store_writable"] is False
    # The store's own lock timeout is the request's deadline (the database gives up when the
    # answer does), so whichever fires first words it: the deadline, or SQLite's busy lock.
    detail = body["store_detail"]
    assert "did not answer within 0.3 s" in detail or "holds the store's write lock" in detail
    assert str(tmp_path) not in ready.text
    # /healthz, sent while readyz waited, answered before readyz did.
    assert alive == 200


def _readyz_beside_healthz(app: FastAPI) -> tuple[httpx.Response, int]:
    """GET /readyz and, once it is in flight, /healthz on the same event loop; the order in
    which they finished tells whether the loop was free."""
    import anyio

    finished: list[str] = []
    results: dict[str, httpx.Response] = {}

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:

            async def get(path: str) -> None:
                results[path] = await client.get(path)
                finished.append(path)

            async with anyio.create_task_group() as group:
                group.start_soon(get, "/readyz")
                await anyio.sleep(0.05)
                group.start_soon(get, "/healthz")

    anyio.run(main)
    assert finished == ["/healthz", "/readyz"], finished
    return results["/readyz"], results["/healthz"].status_code


def test_store_timeout_is_a_setting_with_a_flag() -> None:
    from service.web.settings import Settings

    assert Settings().store_timeout_seconds == 5.0
    with pytest.raises(ValueError, match="store_timeout_seconds"):
        Settings(store_timeout_seconds=0)


class _HeldStore:
    """The service's store with every call held until ``release`` is set: a database server
    that stopped answering (every method, so that a route reading through a new one, such as
    ``latest_per_node``, is held too)."""

    def __init__(self, store: Any, release: threading.Event) -> None:
        self._store = store
        self._release = release

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute) or name == "close":
            return attribute

        def held(*args: Any, **kwargs: Any) -> Any:
            self._release.wait(timeout=30)
            return attribute(*args, **kwargs)

        return held


@pytest.mark.parametrize(
    "limit",
    [{"profile_id": "0123456789abcdef"}, {"model_fingerprint": "abc"}, {"card": "NVIDIA H200"}],
)
def test_a_plan_that_needs_a_hung_store_answers_503_store_busy(
    make_app: Callable[..., FastAPI], limit: dict[str, str]
) -> None:
    app = make_app(store_timeout_seconds=0.2)
    release = threading.Event()
    state = app.state.service
    app.state.service = dataclasses.replace(state, store=_HeldStore(state.store, release))
    body: dict[str, Any] = {"effective_batch_size": 64, **limit}
    if "card" in limit:
        body["model_fingerprint"] = "abc"
    try:
        plan, alive = _post_beside_healthz(app, "/v1/plan", body)
    finally:
        release.set()
        app.state.service = state
    assert plan.status_code == 503, plan.text
    assert plan.json()["type"].endswith("store-busy")
    assert "did not answer within 0.2 s" in plan.json()["detail"]
    assert alive == 200


def _post_beside_healthz(
    app: FastAPI, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, int]:
    import anyio

    finished: list[str] = []
    results: dict[str, httpx.Response] = {}

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:

            async def post() -> None:
                results[path] = await client.post(path, json=body)
                finished.append(path)

            async def health() -> None:
                await anyio.sleep(0.05)
                results["/healthz"] = await client.get("/healthz")
                finished.append("/healthz")

            async with anyio.create_task_group() as group:
                group.start_soon(post)
                group.start_soon(health)

    anyio.run(main)
    assert finished == ["/healthz", path], finished
    return results[path], results["/healthz"].status_code
