"""No secret or server detail in any answer: store passwords masked whatever they hold, store
503s and ``/readyz`` in words without the location or the driver's text, ``Retry-After`` on every
503."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from autobatch.errors import StoreError
from autobatch.store import ProfileStore
from autobatch.store._location import parse_location, password_of, redact
from tests.service.test_service_api import make_profile, problem

NASTY = ["s3/cret", "ab+/=", "p@ss", "p@ss/w:rd", "a:b", "x?y", "60%off"]
"""Passwords a URL parser splits: a slash, base64, an at sign, a colon, a question mark."""


@pytest.mark.parametrize("password", NASTY)
def test_a_password_is_masked_whatever_it_holds(password: str) -> None:
    url = f"postgresql://ci:{password}@db.internal:5432/fleet"
    assert redact(url) == "postgresql://ci:***@db.internal:5432/fleet"
    location = parse_location(url)
    assert location.display == "postgresql://ci:***@db.internal:5432/fleet"
    assert password not in repr(location)
    assert password_of(url) == password
    connect = make_url(location.url)  # what SQLAlchemy and the driver are given
    assert (connect.password, connect.host, connect.database) == (password, "db.internal", "fleet")


def test_a_query_password_is_masked_too() -> None:
    url = "postgresql://db/fleet?sslmode=require&password=q-s3cret&application_name=x"
    assert redact(url) == "postgresql://db/fleet?sslmode=require&password=***&application_name=x"


@pytest.mark.parametrize("password", NASTY)
def test_a_store_that_cannot_connect_never_shows_its_password(password: str) -> None:
    url = f"postgresql://ci:{password}@127.0.0.1:1/fleet"
    with pytest.raises(StoreError) as caught:
        ProfileStore(url, timeout_seconds=1)
    message = str(caught.value)
    assert password not in message and "ci:***@127.0.0.1:1/fleet" in message
    assert caught.value.reason == (
        "cannot open it: the database server cannot be reached or refused the connection"
    )


@pytest.mark.parametrize("password", ["ab+/=", "p@ss/w:rd"])
def test_serve_with_an_unreachable_store_prints_no_password(password: str) -> None:
    # A replica starts while its database is away (not ready until it answers): what it logs of
    # the store it waits for shows the location with the password masked.
    import os
    import signal
    import subprocess
    import sys
    import time

    url = f"postgresql://ci:{password}@127.0.0.1:1/fleet"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "--store-path",
            url,
            "--store-timeout-seconds",
            "1",
            "--port",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert server.stderr is not None
    err, deadline = "", time.monotonic() + 60
    try:
        while "opening it when it answers" not in err and time.monotonic() < deadline:
            line = server.stderr.readline()
            if not line:
                break
            err += line
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            err += server.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            server.kill()
            err += server.communicate()[1]
    assert "opening it when it answers" in err, err
    assert password not in err and "ci:***@127.0.0.1:1/fleet" in err


@contextmanager
def database_gone(url: str) -> Iterator[None]:
    """The database of ``url`` renamed away (its connections ended), then back, through the
    maintenance database of the same server (``$AUTOBATCH_TEST_POSTGRES``'s, or the default)."""
    import psycopg

    server, _, name = url.rpartition("/")
    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        admin.execute(f'ALTER DATABASE "{name}" RENAME TO "{name}_gone"')
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}_gone" RENAME TO "{name}"')


@pytest.mark.parametrize("password", ["ab+/=", "p@ss/w:rd"])
def test_store_503s_and_readyz_carry_no_location_and_no_driver_text(
    make_app: Callable[..., FastAPI],
    postgres_url: str,
    password: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with_password = postgres_url.replace("postgres@", f"postgres:{password}@", 1)
    client = TestClient(make_app(store_path=with_password, store_timeout_seconds=5))
    created = client.post("/v1/profiles", json=make_profile().to_dict())
    assert created.status_code == 201  # trust auth ignores the password: it reached the driver
    name = postgres_url.rpartition("/")[2]
    hidden = [password, name, "127.0.0.1", "5432", "postgres", "psycopg", "does not exist"]
    with database_gone(postgres_url), caplog.at_level(logging.WARNING):
        answers = [
            client.get("/v1/profiles"),
            client.get(f"/v1/profiles/{created.json()['id']}"),
            client.post("/v1/profiles", json=make_profile(node_name="n2").to_dict()),
            client.delete(f"/v1/profiles/{created.json()['id']}"),
        ]
        ready = client.get("/readyz")
    for answer in answers:
        body = problem(answer, 503, "store-unavailable")
        assert answer.headers["Retry-After"] == "5"
        assert body["detail"].startswith("the profile store failed: cannot ")
        assert "the database server cannot be reached or refused the connection" in body["detail"]
        assert not [word for word in hidden if word in answer.text]
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
    assert ready.json()["store_writable"] is False
    assert "cannot be reached" in ready.json()["store_detail"]
    assert not [word for word in hidden if word in ready.text]
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert name in logged and "postgres:***@" in logged  # the detail is in the log, masked
    assert password not in logged


def test_every_503_says_when_to_retry(make_app: Callable[..., FastAPI], tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    app = make_app(store_path=str(path))
    client = TestClient(app)
    app.state.service.store.close()
    answer = client.get("/v1/profiles")
    body = problem(answer, 503, "store-unavailable")
    assert answer.headers["Retry-After"] == "5"
    assert body["detail"] == (
        "the profile store failed: it is closed (the server's log has the details); retry later"
    )
    assert str(tmp_path) not in answer.text
    ready = client.get("/readyz")
    assert (ready.status_code, ready.headers["Retry-After"]) == (503, "5")


def test_public_text_hides_store_urls_and_paths() -> None:
    """What a probe run's error and library errors answer: the store's URL (user, host,
    database) and the server's paths are the log's, not the client's."""
    from service.web.problems import public_text

    text = (
        "profile store postgresql://ci:***@db.internal:5432/fleet: cannot store a profile: x; "
        "or sqlite:////var/lib/autobatch/p.sqlite3, near /var/lib/autobatch"
    )
    assert public_text(text) == (
        "profile store <store>: cannot store a profile: x; or <store>, near <path>"
    )
