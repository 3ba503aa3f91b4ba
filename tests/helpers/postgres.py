"""A throwaway PostgreSQL database per test, or a skip that names what is missing.

The server is ``$AUTOBATCH_TEST_POSTGRES`` (a URL of its maintenance database) or, unset,
``postgresql://postgres@127.0.0.1:5432/postgres`` (the project's machines: trust auth). Set
``AUTOBATCH_TEST_POSTGRES=required`` (``.ci/run`` does) to make a missing server fail the tests
instead of skipping them. Each database is ``autobatch_test_<hex>``, dropped afterwards: other
users of the server are never touched.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
ENV_VAR = "AUTOBATCH_TEST_POSTGRES"


def _server() -> tuple[str, bool]:
    value = os.environ.get(ENV_VAR, "")
    if value == "required":
        return DEFAULT_SERVER, True
    return value or DEFAULT_SERVER, bool(value)


def _missing(reason: str, required: bool) -> None:
    message = (
        f"{reason}: set {ENV_VAR}=postgresql://USER@HOST:PORT/postgres to use another server"
        f" ({ENV_VAR}=required makes this a failure)"
    )
    if required:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@contextmanager
def postgres_database() -> Iterator[str]:
    """Create ``autobatch_test_<hex>`` and yield its URL; drop it afterwards."""
    server, required = _server()
    try:
        import psycopg
    except ImportError:
        _missing("psycopg is not installed (pip install 'autobatch[postgres]')", required)
    name = f"autobatch_test_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(server, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        where = server.rpartition("@")[2].partition("/")[0]
        _missing(f"no PostgreSQL on {where} ({str(exc).strip().splitlines()[0]})", required)
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield server.rpartition("/")[0] + "/" + name
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
