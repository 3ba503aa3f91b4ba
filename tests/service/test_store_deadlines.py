"""Every route that touches the store answers by the store deadline while the database is
locked, on SQLite and PostgreSQL; routes that do not touch it keep answering meanwhile; a burst
beyond the connection pool waits for a connection rather than failing at once."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.profile import Profile
from service.web.store_calls import STORE_THREADS, StoreCalls
from tests.store.test_store import make_profile

DEADLINE_S = 1.0


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "store.sqlite3")
    url: str = request.getfixturevalue("postgres_url")
    return url


@contextlib.contextmanager
def locked(location: str) -> Iterator[Callable[[], None]]:
    """The profiles table locked by another client, as a long migration or a frozen writer
    would; yields a function that releases the lock early."""
    if location.startswith("postgresql"):
        import psycopg

        conn: Any = psycopg.connect(location.replace("+psycopg", ""), autocommit=True)
        conn.execute("BEGIN")
        conn.execute("LOCK TABLE profiles IN ACCESS EXCLUSIVE MODE")
    else:
        conn = sqlite3.connect(location, isolation_level=None, check_same_thread=False)
        conn.execute("BEGIN EXCLUSIVE")
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            conn.execute("ROLLBACK")
            conn.close()

    try:
        yield release
    finally:
        release()


def _profile_body(profile: Profile) -> dict[str, Any]:
    return profile.to_dict()


def _store_requests(profile_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    return [
        ("POST", "/v1/profiles", _profile_body(make_profile(num_steps=99))),
        ("GET", "/v1/profiles", None),
        ("GET", f"/v1/profiles/{profile_id}", None),
        ("GET", "/v1/profile-summaries", None),
        ("DELETE", f"/v1/profiles/{profile_id}", None),
        ("POST", "/v1/plan", {"model_fingerprint": "abc", "effective_batch_size": 64}),
        ("POST", "/v1/plan", {"profile_id": profile_id, "effective_batch_size": 64}),
    ]


def _send_all(
    app: FastAPI, requests: list[tuple[str, str, dict[str, Any] | None]], *, then: str
) -> tuple[list[tuple[httpx.Response, float]], list[str]]:
    """Every request at once and, once they are in flight, ``GET then``; each response with
    its seconds, and the order in which the paths finished."""
    results: list[tuple[httpx.Response, float]] = [None] * len(requests)  # type: ignore[list-item]
    finished: list[str] = []

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://service", timeout=60
        ) as client:

            async def send(index: int) -> None:
                method, path, body = requests[index]
                started = time.perf_counter()
                response = await client.request(method, path, json=body)
                results[index] = (response, time.perf_counter() - started)
                finished.append(path)

            async def other() -> None:
                await anyio.sleep(0.1)
                assert (await client.get(then)).status_code == 200
                finished.append(then)

            async with anyio.create_task_group() as group:
                for index in range(len(requests)):
                    group.start_soon(send, index)
                group.start_soon(other)

    anyio.run(main)
    return results, finished


def test_every_store_route_answers_by_the_deadline_while_the_table_is_locked(
    make_app: Callable[..., FastAPI], store_location: str
) -> None:
    app = make_app(store_path=store_location, store_timeout_seconds=DEADLINE_S)
    store = app.state.service.store
    profile_id = store.put(make_profile())
    requests = _store_requests(profile_id)
    if store.backend == "sqlite":  # WAL: readers go on beside a writer; writes wait for it
        requests = [r for r in requests if r[0] in ("POST", "DELETE") and "profiles" in r[1]]
    # More requests than the store has threads: the others wait their turn within the deadline.
    requests = requests * (2 * STORE_THREADS // len(requests) + 1)
    with locked(store_location):
        results, finished = _send_all(app, requests, then="/v1/probes")
    for (method, path, _), (response, seconds) in zip(requests, results, strict=True):
        assert response.status_code == 503, (method, path, response.text)
        problem = response.json()
        # the request's deadline, or the database's own timeout at the same deadline
        assert problem["type"].rsplit(":", 1)[1] in ("store-busy", "store-unavailable")
        assert seconds < DEADLINE_S + 3, (method, path, seconds)
    # /v1/probes, sent after them, never waited on the store or its threads.
    assert finished.index("/v1/probes") < len(finished) - len(requests)
    # The store's threads were given back: with the lock gone, the store answers again (a
    # call that was running at its deadline may have finished since: a 503 is no promise that
    # a write did not happen, as with any timeout: the same profile then answers 200, stored).
    client = TestClient(app)
    again = client.post("/v1/profiles", json=requests[0][2])
    assert again.status_code in (200, 201), again.text
    assert client.get(again.headers["Location"]).json()["profile"]["num_steps"] == 99


def test_a_burst_beyond_the_pool_waits_for_a_connection(
    make_app: Callable[..., FastAPI], store_location: str
) -> None:
    """16 publishers at once while a lock is held for a short while: every one is stored (none
    refused at once for want of a connection or a thread)."""
    app = make_app(store_path=store_location, store_timeout_seconds=10.0)
    bodies = [_profile_body(make_profile(num_steps=n + 1)) for n in range(16)]
    requests = [("POST", "/v1/profiles", body) for body in bodies]
    with locked(store_location) as release:
        threading.Timer(1.0, release).start()
        results, _ = _send_all(app, requests, then="/healthz")
    assert [response.status_code for response, _ in results] == [201] * 16
    assert len(app.state.service.store.list_profiles(limit=100)) == 16


def test_store_calls_hold_at_most_their_threads_and_drop_what_waited_past_its_deadline() -> None:
    """A call still queued at its deadline never runs; at most ``max_threads`` run at once."""
    calls = StoreCalls(timeout_seconds=0.2, max_threads=2)
    gate = threading.Event()
    ran: list[int] = []

    def held(index: int) -> int:
        ran.append(index)
        gate.wait(10)
        return index

    async def main() -> list[str]:
        outcomes: list[str] = []

        async def one(index: int) -> None:
            try:
                outcomes.append(str(await calls(held, index)))
            except Exception as exc:  # noqa: BLE001 - the Problem is the outcome
                outcomes.append(getattr(exc, "slug", repr(exc)))

        async with anyio.create_task_group() as group:
            for index in range(6):
                group.start_soon(one, index)
        return outcomes

    outcomes = anyio.run(main)
    gate.set()
    assert outcomes == ["store-busy"] * 6
    assert len(ran) == 2  # two ran; the four queued behind them were dropped at the deadline
    calls.close()


def test_readyz_is_not_ready_while_the_profiles_table_is_locked(
    make_app: Callable[..., FastAPI], store_location: str
) -> None:
    """Readiness reads the profiles table under the store's deadline, as the routes do."""
    app = make_app(store_path=store_location, store_timeout_seconds=DEADLINE_S)
    client = TestClient(app)
    assert client.get("/readyz").status_code == 200
    with locked(store_location):
        started = time.perf_counter()
        answer = client.get("/readyz")
        seconds = time.perf_counter() - started
        # PostgreSQL's lock stops reads too; SQLite's (WAL) stops only the writes.
        read = client.get("/v1/profiles").status_code
        assert read == (503 if store_location.startswith("postgresql") else 200)
        assert client.post("/v1/profiles", json=_profile_body(make_profile())).status_code == 503
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"].isdigit()
    assert answer.json()["ready"] is False and answer.json()["store_writable"] is False
    assert seconds < DEADLINE_S + 3
    assert client.get("/readyz").status_code == 200
