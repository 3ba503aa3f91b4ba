"""The profile store's link to its database: opening it, short transactions, and the one place
where database errors become :class:`~autobatch.errors.StoreError`.

:class:`StoreConnection` opens a location (:mod:`autobatch.store._location`): it creates a
SQLite file's directory, builds the engine (:mod:`autobatch.store._engine`), checks or
migrates the schema (:mod:`autobatch.store._schema`) and turns on WAL. Its :meth:`read` and
:meth:`write` give one connection or one short write transaction (``BEGIN IMMEDIATE`` on
SQLite), serialised by a lock on SQLite (one connection shared by threads), from a small pool on
PostgreSQL. :class:`~autobatch.store._store.ProfileStore` writes its SQL on top of it.

It recovers without a restart: a database that could not be reached (and, with ``open_later``,
one not there at open) is checked, created or migrated again on the next call once it answers;
a call that finds the tables gone (a database dropped and created again) fails, and the next
one creates them (under the schema's advisory lock, so replicas do it once); a SQLite file
deleted or replaced since it was opened is opened again at its path (a new store where none is).
SQLAlchemy is imported when a store is opened, not when this module is. Imports neither torch
nor pynvml.

Example::

    connection = StoreConnection(parse_location("profiles.sqlite3"), timeout_seconds=30.0)
    with connection.write("store a profile") as conn:
        conn.execute(statement)      # committed unless the block raises
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from autobatch.errors import StoreError
from autobatch.store._location import Create, StoreLocation, prepare_file

# _engine and _schema import SQLAlchemy: the functions here import them when
# called, so that importing the store (``from autobatch import ProfileStore``) stays
# SQLAlchemy-free.

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = ["StoreConnection"]

_log = logging.getLogger("autobatch.store")
_MISSING_TABLE = ("42P01", "no such table")  # PostgreSQL's undefined_table; SQLite's message


class StoreConnection:
    """An open profile store's database: its engine, its lock, its transactions.

    Args:
        location: where the store is.
        timeout_seconds: how long a call waits for another writer's lock (or a PostgreSQL
            connection) before giving up, in seconds.
        open_later: when the database cannot be reached now, return anyway; each call tries
            to open it again (and raises StoreError until it answers).

    Raises:
        StoreError: the store cannot be opened or created (permissions, a directory in the way,
            no server), is not an autobatch store, was written by a newer autobatch, or is
            damaged. It is left untouched in every case.
    """

    def __init__(
        self,
        location: StoreLocation,
        *,
        timeout_seconds: float,
        create: Create = "folders",
        open_later: bool = False,
    ) -> None:
        self.location = location
        self.display = location.display
        """Where the store is, as it may be shown: the file, or the URL without its password."""
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if location.backend == "sqlite" else contextlib.nullcontext()
        )
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        self._timeout_seconds = timeout_seconds
        self._identity: tuple[int, int] | None = None
        self._journal: dict[str, tuple[int, int] | None] = {}
        """Identities of the file's ``-wal`` and ``-shm`` that this store's connection opened."""
        path = location.path
        self._file = path if path is not None and not location.in_memory else None
        if self._file is not None:
            prepare_file(self._file, create)
        from autobatch.store._engine import make_engine

        self._engine: sa.Engine | None = None
        with self.errors("open it"):
            self._engine = make_engine(location, timeout_seconds=timeout_seconds)
        try:
            self._open_schema()
        except StoreError as exc:
            if open_later and self._unreachable(exc.__cause__):
                _log.warning("%s; opening it when it answers", exc)
                return
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _open_schema(self) -> None:
        """Check, create or migrate the schema (once, whichever thread gets here first), and
        on SQLite turn on WAL and note the file's identity."""
        from autobatch.store._engine import file_identity, use_wal
        from autobatch.store._schema import open_schema

        with self._schema_lock:
            if self._schema_ready:
                return
            engine = self._engine_or_raise()
            with self.errors("open it"), engine.connect() as conn:
                open_schema(conn, backend=self.location.backend, display=self.display)
                if self._file is not None:
                    use_wal(conn, timeout_seconds=self._timeout_seconds)
                    conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").all()
                    self._identity = file_identity(self._file)
                    self._journal = {
                        suffix: file_identity(self._file.with_name(self._file.name + suffix))
                        for suffix in ("-wal", "-shm")
                    }
            self._schema_ready = True

    def _unreachable(self, cause: BaseException | None) -> bool:
        """Whether ``cause`` says the database cannot be reached (no server, no such database,
        a connection lost): the driver's OperationalError."""
        engine = self._engine
        if cause is None or engine is None:
            return False
        return isinstance(cause, engine.dialect.loaded_dbapi.OperationalError)

    def _forget_journal(self) -> None:
        """Delete the ``-wal`` and ``-shm`` the closed connection left at the file's path, when
        they are still the ones it opened: SQLite keeps a WAL whose database was unlinked or
        moved, and would replay its pages into whatever file is opened at that path next."""
        from autobatch.store._engine import file_identity

        assert self._file is not None
        for suffix, identity in self._journal.items():
            journal = self._file.with_name(self._file.name + suffix)
            if identity is not None and file_identity(journal) == identity:
                with contextlib.suppress(FileNotFoundError):
                    journal.unlink()

    def _ready_engine(self) -> sa.Engine:
        """The engine, its schema checked once more where a failure put it in doubt, and a
        SQLite file opened again when it was deleted or replaced (called under the lock)."""
        from autobatch.store._engine import file_identity, make_engine

        engine = self._engine_or_raise()
        if self._file is not None and self._schema_ready:
            now = file_identity(self._file)
            if now != self._identity:
                what = "deleted" if now is None else "replaced by another file"
                _log.warning(
                    "the profile store %s was %s after it was opened; opening it again",
                    self._file,
                    what,
                )
                engine.dispose()  # the one connection holds the old file open
                self._forget_journal()
                with self.errors("open it again"):
                    engine = make_engine(self.location, timeout_seconds=self._timeout_seconds)
                self._engine, self._schema_ready = engine, False
        if not self._schema_ready:
            self._open_schema()
        return engine

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

        from autobatch.store._engine import store_error

        try:
            yield
        except sqlalchemy.exc.SQLAlchemyError as exc:
            cause = getattr(exc, "orig", None) or exc
            lost = self.location.backend == "postgresql" and self._unreachable(cause)
            if lost or _missing_table(cause):
                self._schema_ready = False  # the next call checks (or creates) the schema
            raise store_error(self.location, doing, cause) from cause
        except sqlite3.Error as exc:  # raised by the driver outside SQLAlchemy (use_wal)
            raise store_error(self.location, doing, exc) from exc

    @contextlib.contextmanager
    def read(self, doing: str) -> Iterator[sa.Connection]:
        """One connection to read with; errors translated.

        Raises:
            StoreError: the store is closed or unreadable.
        """
        with self._lock:
            engine = self._ready_engine()
            with self.errors(doing), engine.connect() as conn:
                yield conn

    @contextlib.contextmanager
    def write(self, doing: str) -> Iterator[sa.Connection]:
        """One short write transaction (``BEGIN IMMEDIATE`` on SQLite), committed unless the
        body raises.

        Raises:
            StoreError: the store is closed, locked longer than the timeout, or not writable.
        """
        with self._lock:
            engine = self._ready_engine()
            with (
                self.errors(doing),
                engine.connect() as conn,
                conn.execution_options(autobatch_write=True).begin(),
            ):
                yield conn

    def check_writable(self) -> None:
        """Check that a write would succeed now (for a readiness probe); writes nothing.

        Takes the write lock, reads a row of the profiles table (what every profile route
        needs: a table another client holds locked fails the check by the store's timeout) and
        makes a change that is rolled back. A SQLite file deleted or
        replaced since it was opened is opened again first, and tables found gone (a database
        dropped and created again) are created and the check made once more: the store
        recovers here, without a restart.

        Raises:
            StoreError: the store is closed, read-only, locked by another writer for longer
                than the timeout, unreachable, not an autobatch store (a file that replaced
                it), or the disk holding it has under ``MIN_FREE_BYTES`` (1 MiB) free.
        """
        import sqlalchemy as sa

        from autobatch.store._engine import MIN_FREE_BYTES, free_bytes
        from autobatch.store._schema import profiles, store_meta

        if self._file is not None and self._engine is not None:
            free = free_bytes(self._file)
            if free < MIN_FREE_BYTES:
                raise StoreError(
                    f"the disk holding the profile store {self._file} is full ({free} bytes "
                    f"free, under {MIN_FREE_BYTES}): writes would fail; free some space there",
                    reason=f"the disk holding it is full ({free} bytes free): writes would fail",
                )
        for last in (False, True):
            try:
                with (
                    contextlib.suppress(_Rollback),
                    self.write("check that it is writable") as conn,
                ):
                    conn.execute(sa.select(profiles.c.id).limit(1)).all()
                    conn.execute(
                        sa.update(store_meta)
                        .where(store_meta.c.key == "schema_version")
                        .values(value=store_meta.c.value)
                    )
                    raise _Rollback
                return
            except StoreError as exc:
                cause = exc.__cause__
                if last or self._schema_ready or cause is None or not _missing_table(cause):
                    raise

    def _engine_or_raise(self) -> sa.Engine:
        if self._engine is None:
            raise StoreError(f"the profile store {self.display} is closed", reason="it is closed")
        return self._engine


def _missing_table(cause: BaseException) -> bool:
    """Whether a driver's error says a table of the store is not there."""
    code = str(getattr(cause, "sqlstate", "") or "")
    return code == _MISSING_TABLE[0] or _MISSING_TABLE[1] in str(cause)


class _Rollback(Exception):
    """Raised inside :meth:`StoreConnection.write` to end the transaction without committing."""
