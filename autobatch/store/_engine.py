"""The store's connections: engines for SQLite and PostgreSQL, the SQLite journal, the errors.

Part of the store (:mod:`autobatch.store._store`), split off to keep that module to its API.
SQLite: one connection per store (used under the store's lock), autocommit at the driver, every
transaction begun by autobatch (``BEGIN``, or ``BEGIN IMMEDIATE`` for a write, so that a writer
waits for the lock up front rather than failing at commit), the WAL journal. PostgreSQL: psycopg
3, a small pool with a liveness check and a short wait for a free connection, and lock/statement
timeouts from the store's timeout set per transaction (``SET LOCAL``), which hold behind a
transaction-mode pooler such as PgBouncer.

Example::

    engine = make_engine(parse_location("postgresql://db/profiles"), timeout_seconds=30)
"""

from __future__ import annotations

import pathlib
import random
import re
import shutil
import time
from typing import Any

import sqlalchemy as sa

from autobatch.errors import StoreError
from autobatch.extras import require
from autobatch.store._location import STORE_ENV_VAR, StoreLocation, password_of

__all__ = [
    "POOL_WAIT_FRACTION",
    "describe_error",
    "file_identity",
    "insert",
    "make_engine",
    "pooler_refusal",
    "store_error",
    "use_wal",
]


def describe_error(location: StoreLocation, doing: str, exc: BaseException) -> str:
    """A StoreError message: what failed, on which store, and the fix (no password)."""
    text = " ".join(str(exc).split())  # one line (psycopg's messages span several)
    password = password_of(location.url)
    if password:
        text = text.replace(password, "***")
    _reason, fix = _classify(location, text)
    return f"profile store {location.display}: cannot {doing}: {text}; {fix}"


def store_error(location: StoreLocation, doing: str, exc: BaseException) -> StoreError:
    """The StoreError for ``exc``: :func:`describe_error`'s message, and a ``reason`` that
    names neither the location nor the driver's text (what a service may answer)."""
    reason, _fix = _classify(location, str(exc))
    return StoreError(describe_error(location, doing, exc), reason=f"cannot {doing}: {reason}")


def _classify(location: StoreLocation, text: str) -> tuple[str, str]:
    """What went wrong, in words without the location, and the fix, from a driver's message."""
    lowered = text.lower()
    refused = pooler_refusal(text)
    if refused is not None:
        return "a connection pooler in front of the database refused a startup parameter", refused
    if "not a database" in lowered or "malformed" in lowered:
        return "the store's file is not a valid SQLite database", (
            f"the file is not a valid SQLite database; move it away (or set {STORE_ENV_VAR} "
            "to another location) and autobatch will create a new store"
        )
    if "locked" in lowered or "busy" in lowered or "lock timeout" in lowered:
        return "another process holds the store's write lock", (
            "another process holds the store's write lock; retry, or raise the timeout"
        )
    if "readonly" in lowered or "read-only" in lowered or "unable to open" in lowered:
        return "the store cannot be opened for writing", (
            f"check the file's and its directory's permissions, or set {STORE_ENV_VAR} to a "
            "writable file"
        )
    if location.backend == "postgresql" and (
        "connect" in lowered or "does not exist" in lowered or "authentication" in lowered
    ):
        return "the database server cannot be reached or refused the connection", (
            f"check that the PostgreSQL server is up and the database exists, or set "
            f"{STORE_ENV_VAR} to another location"
        )
    return "the database failed", f"set {STORE_ENV_VAR} to another location if it persists"


def pooler_refusal(text: str) -> str | None:
    """The fix, when a connection pooler in front of PostgreSQL (PgBouncer) refused a startup
    parameter of the connection (``unsupported startup parameter: options``); else None."""
    found = re.search(r"unsupported startup parameter:?\s*([\w.]+)", text, re.IGNORECASE)
    if found is None:
        return None
    name = found.group(1)
    return (
        f"a connection pooler in front of the database (PgBouncer) refused the startup "
        f"parameter {name!r}: remove {name!r} from the store's URL, or list it in the "
        f"pooler's ignore_startup_parameters (autobatch sets its own timeouts per transaction, "
        f"which a transaction-mode pooler keeps)"
    )


def insert(backend: str, table: sa.Table) -> Any:
    if backend == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(table)


POOL_WAIT_FRACTION = 0.25
"""A call waits at most this share of the store's timeout for a free PostgreSQL connection:
long enough to ride out a burst beyond the pool, short enough that the rest of the deadline is
left for the call itself."""


_SET_TIMEOUTS = (
    "SELECT set_config('statement_timeout', %(ms)s, true), set_config('lock_timeout', %(ms)s, true)"
)


def make_engine(location: StoreLocation, *, timeout_seconds: float) -> sa.Engine:
    from sqlalchemy import event, pool

    if location.backend == "postgresql":
        # SQLAlchemy imports the driver inside create_engine; a missing one is named here.
        require(
            "psycopg", extra="postgres", purpose=f"the PostgreSQL profile store {location.display}"
        )
        engine = sa.create_engine(
            location.url,
            pool_pre_ping=True,
            pool_size=4,
            max_overflow=8,
            pool_timeout=timeout_seconds * POOL_WAIT_FRACTION,
            connect_args={
                "connect_timeout": max(1, int(timeout_seconds)),
                # No server-side prepared statements: a transaction-mode pooler (PgBouncer)
                # hands each transaction to any server connection, where they do not exist.
                "prepare_threshold": None,
            },
        )
        timeout_ms = str(max(1, int(timeout_seconds * 1000)))

        @event.listens_for(engine, "begin")
        def _timeouts(conn: sa.Connection) -> None:
            # Per transaction, not as a startup parameter (``options=-c ...``): a pooler in
            # transaction mode refuses or drops those, and shares server connections between
            # clients; SET LOCAL holds for this transaction on whichever connection runs it.
            # On the driver's own cursor: the transaction's first statement may have asked
            # SQLAlchemy for a server-side one (stream_results).
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                cursor.execute(_SET_TIMEOUTS, {"ms": timeout_ms})
            finally:
                cursor.close()

        return engine
    # one connection, used under the store's lock by whichever thread holds it
    engine = sa.create_engine(
        location.url,
        poolclass=pool.StaticPool,
        connect_args={"timeout": timeout_seconds, "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions begin where _begin says

    @event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get("autobatch_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def use_wal(conn: sa.Connection, *, timeout_seconds: float) -> None:
    """Switch the file to the WAL journal (kept in the file, so done once per file).

    The switch needs an exclusive lock and SQLite does not wait for one here (no busy handler):
    while other processes read the file as they open it, it fails at once with "database is
    locked". Retried until ``timeout_seconds``, as the busy timeout would.
    """
    import sqlite3

    raw = conn.connection.driver_connection  # outside any transaction: WAL cannot switch in one
    assert isinstance(raw, sqlite3.Connection)
    deadline = time.monotonic() + timeout_seconds
    while True:
        if str(raw.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
            return
        try:
            raw.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(random.uniform(0.001, 0.01))


MIN_FREE_BYTES = 1 << 20
"""Free bytes a SQLite store's filesystem must keep for the store to count as writable: a
rolled-back test write allocates nothing, so on a full disk it succeeds while every real write
(a profile is up to a few hundred KB of JSON) fails."""


def free_bytes(path: pathlib.Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    return shutil.disk_usage(path.parent).free


def file_identity(path: pathlib.Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino
