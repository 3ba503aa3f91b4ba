"""A replica whose database is away: it starts anyway (not ready, alive), and recovers when the
database answers or is dropped and created again, without a restart (PostgreSQL)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from autobatch.store import ProfileStore
from tests.helpers.postgres import DEFAULT_SERVER
from tests.service.serving import free_port, serving
from tests.service.test_service_api import make_profile


@pytest.fixture
def admin(postgres_url: str) -> Iterator[Any]:
    """An autocommit connection to the server's maintenance database (the fixture's server)."""
    import psycopg

    server = postgres_url.rpartition("/")[0] + "/" + DEFAULT_SERVER.rpartition("/")[2]
    with psycopg.connect(server, autocommit=True) as connection:
        yield connection


@contextmanager
def _database_named_later(admin: Any, postgres_url: str) -> Iterator[tuple[str, str]]:
    """``(name, url)`` of a database that does not exist yet; dropped afterwards."""
    name = f"autobatch_test_{secrets.token_hex(6)}"
    try:
        yield name, postgres_url.rpartition("/")[0] + "/" + name
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _ready_within(client: TestClient, seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while (answer := client.get("/readyz")).status_code != 200:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.1)
    return answer


def test_a_replica_started_before_its_database_is_ready_once_it_exists(
    make_app: Callable[..., Any], admin: Any, postgres_url: str
) -> None:
    with _database_named_later(admin, postgres_url) as (name, url):
        client = TestClient(make_app(store_path=url))
        assert client.get("/healthz").status_code == 200
        away = client.get("/readyz")
        assert away.status_code == 503 and away.json()["store_writable"] is False
        assert client.post("/v1/profiles", json=make_profile().to_dict()).status_code == 503

        admin.execute(f'CREATE DATABASE "{name}"')
        _ready_within(client)
        created = client.post("/v1/profiles", json=make_profile().to_dict())
        assert created.status_code == 201, created.text


def test_a_dropped_and_recreated_database_is_recreated_without_a_restart(
    make_app: Callable[..., Any], admin: Any, postgres_url: str
) -> None:
    name = postgres_url.rpartition("/")[2]
    client = TestClient(make_app(store_path=postgres_url))
    assert client.post("/v1/profiles", json=make_profile().to_dict()).status_code == 201

    admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    assert client.get("/readyz").status_code == 503  # no database: not ready, still alive
    admin.execute(f'CREATE DATABASE "{name}"')
    _ready_within(client)
    assert client.get("/v1/profiles").json()["profiles"] == []  # a new, empty store
    created = client.post("/v1/profiles", json=make_profile(node_name="again").to_dict())
    assert created.status_code == 201, created.text
    listed = client.get("/v1/profiles").json()["profiles"]
    assert [entry["id"] for entry in listed] == [created.json()["id"]]


def test_replicas_racing_to_create_the_schema_create_it_once(admin: Any, postgres_url: str) -> None:
    with _database_named_later(admin, postgres_url) as (name, url):
        stores = [ProfileStore(url, open_later=True, timeout_seconds=10) for _ in range(4)]
        admin.execute(f'CREATE DATABASE "{name}"')
        failures: list[BaseException] = []

        def check(store: ProfileStore) -> None:
            try:
                store.check_writable()
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=check, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failures == []
        ids = {store.put(make_profile()) for store in stores}
        assert len(ids) == 1 and len(stores[0].list_profiles()) == 1
        for store in stores:
            store.close()


@pytest.mark.slow  # a server start
def test_a_replica_whose_database_port_is_closed_serves_and_is_not_ready(
    tmp_path: Path,
) -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/none"
    with serving(tmp_path, "--store-path", url) as replica:
        assert replica.client.get("/healthz").status_code == 200
        answer = replica.client.get("/readyz")
        assert answer.status_code == 503 and answer.json()["store_writable"] is False
        assert replica.process.poll() is None
