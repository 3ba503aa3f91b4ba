"""The profile store's link to its database: opening it, short transactions, and the one place
where database errors become :class:`~autobatch.errors.StoreError`.

:class:`StoreConnection` opens a location (:mod:`autobatch.profiles._location`): it creates a
SQLite file's directory, builds the engine (:mod:`autobatch.profiles._engine`), checks or
migrates the schema (:mod:`autobatch.profiles._schema`) and turns on WAL. Its :meth:`read` and
:meth:`write` give one connection or one short write transaction (``BEGIN IMMEDIATE`` on
SQLite), serialised by a lock on SQLite (one connection shared by threads), from a small pool on
PostgreSQL. :class:`~autobatch.profiles._store.ProfileStore` writes its SQL on top of it.
SQLAlchemy is imported when a store is opened, not when this module is. Imports neither torch
nor pynvml.

Example::

    connection = StoreConnection(parse_location("profiles.sqlite3"), timeout_seconds=30.0)
    with connection.write("store a profile") as conn:
        conn.execute(statement)      # committed unless the block raises
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from autobatch.errors import StoreError
from autobatch.profiles._location import Create, StoreLocation, prepare_file

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = ["StoreConnection"]


class StoreConnection:
    """An open profile store's database: its engine, its lock, its transactions.

    Args:
        location: where the store is.
        timeout_seconds: how long a call waits for another writer's lock (or a PostgreSQL
            connection) before giving up, in seconds.

    Raises:
        StoreError: the store cannot be opened or created (permissions, a directory in the way,
            no server), is not an autobatch store, was written by a newer autobatch, or is
            damaged. It is left untouched in every case.
    """

    def __init__(
        self, location: StoreLocation, *, timeout_seconds: float, create: Create = "folders"
    ) -> None:
        self.location = location
        self.display = location.display
        """Where the store is, as it may be shown: the file, or the URL without its password."""
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if location.backend == "sqlite" else contextlib.nullcontext()
        )
        self._identity: tuple[int, int] | None = None
        path = location.path
        on_disk = path is not None and not location.in_memory
        if path is not None and on_disk:
            prepare_file(path, create)
        from autobatch.profiles._engine import file_identity, make_engine, use_wal

        self._engine: sa.Engine | None = None
        with self.errors("open it"):
            self._engine = make_engine(location, timeout_seconds=timeout_seconds)
        try:
            from autobatch.profiles._schema import open_schema

            with self.errors("open it"), self._engine.connect() as conn:
                open_schema(conn, backend=location.backend, display=self.display)
                if path is not None and on_disk:
                    use_wal(conn, timeout_seconds=timeout_seconds)
                    self._identity = file_identity(path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connections. Idempotent; any later call raises StoreError."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()

    @contextlib.contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Translate SQLAlchemy's and the drivers' errors into StoreError (the one place).

        Args:
            doing: what was being done, for the message, e.g. ``"store a profile"``.
        """
        import sqlite3

        import sqlalchemy.exc

        from autobatch.profiles._engine import describe_error

        try:
            yield
        except sqlalchemy.exc.SQLAlchemyError as exc:
            cause = getattr(exc, "orig", None) or exc
            raise StoreError(describe_error(self.location, doing, cause)) from cause
        except sqlite3.Error as exc:  # raised by the driver outside SQLAlchemy (use_wal)
            raise StoreError(describe_error(self.location, doing, exc)) from exc

    @contextlib.contextmanager
    def read(self, doing: str) -> Iterator[sa.Connection]:
        """One connection to read with; errors translated.

        Raises:
            StoreError: the store is closed or unreadable.
        """
        with self._lock, self.errors(doing), self._engine_or_raise().connect() as conn:
            yield conn

    @contextlib.contextmanager
    def write(self, doing: str) -> Iterator[sa.Connection]:
        """One short write transaction (``BEGIN IMMEDIATE`` on SQLite), committed unless the
        body raises.

        Raises:
            StoreError: the store is closed, locked longer than the timeout, or not writable.
        """
        with (
            self._lock,
            self.errors(doing),
            self._engine_or_raise().connect() as conn,
            conn.execution_options(autobatch_write=True).begin(),
        ):
            yield conn

    def check_writable(self) -> None:
        """Check that a write would succeed now (for a readiness probe); writes nothing.

        Takes the write lock and makes a change that is rolled back. A SQLite file that was
        deleted or replaced since it was opened fails the check: writes would go to a file no
        other process (nor a restart) sees.

        Raises:
            StoreError: the store is closed, read-only, locked by another writer for longer
                than the timeout, unreachable, its file was deleted or replaced, or the disk
                holding it has under ``MIN_FREE_BYTES`` (1 MiB) free.
        """
        import sqlalchemy as sa

        from autobatch.profiles._engine import MIN_FREE_BYTES, file_identity, free_bytes
        from autobatch.profiles._schema import store_meta

        path = self.location.path
        if self._identity is not None and path is not None:
            now = file_identity(path)
            if now != self._identity:
                what = "deleted" if now is None else "replaced by another file"
                raise StoreError(
                    f"the profile store {path} was {what} after it was opened: what is "
                    "written now would be lost; restart the service (it opens the file anew)"
                )
            free = free_bytes(path)
            if free < MIN_FREE_BYTES:
                raise StoreError(
                    f"the disk holding the profile store {path} is full ({free} bytes "
                    f"free, under {MIN_FREE_BYTES}): writes would fail; free some space there"
                )
        with contextlib.suppress(_Rollback), self.write("check that it is writable") as conn:
            conn.execute(
                sa.update(store_meta)
                .where(store_meta.c.key == "schema_version")
                .values(value=store_meta.c.value)
            )
            raise _Rollback

    def _engine_or_raise(self) -> sa.Engine:
        if self._engine is None:
            raise StoreError(f"the profile store {self.display} is closed")
        return self._engine


class _Rollback(Exception):
    """Raised inside :meth:`StoreConnection.write` to end the transaction without committing."""
