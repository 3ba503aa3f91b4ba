"""The service never waits on the store on its event loop: a store locked by another process
makes ``/readyz`` answer "not ready" at its deadline while ``/healthz`` keeps answering."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

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
    assert "did not answer within 0.3 s" in body["store_detail"]
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
    from service.settings import Settings

    assert Settings().store_timeout_seconds == 5.0
    with pytest.raises(ValueError, match="store_timeout_seconds"):
        Settings(store_timeout_seconds=0)
