"""Profiles in SQLite: the embedded default store, and the only module that speaks SQL.

Uses the standard library's ``sqlite3`` and imports neither torch nor pynvml, so the CLI and the
service can read and write profiles on machines without a GPU. One file may be shared by several
processes (WAL journal, a busy timeout, short ``BEGIN IMMEDIATE`` write transactions) and one
:class:`ProfileStore` may be shared by the threads of one process.

The file is never overwritten or migrated silently: a file that is not an autobatch store, or one
written by a newer autobatch, raises :class:`~autobatch.errors.StoreError` naming the file and the
fix, and is left as it was.

Example::

    from autobatch.profiles.store import ProfileStore

    # ProfileStore() opens $AUTOBATCH_STORE, else ~/.cache/autobatch/profiles.sqlite3
    with ProfileStore() as store:
        profile_id = store.put(profile)
        found = store.find(profile.cache_key())
        if found is not None:
            profile_id, cached = found
        for profile_id, stored in store.list_profiles(model_fingerprint="9f2c...", limit=10):
            print(profile_id, stored.device_name, stored.max_micro_batch_size)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from autobatch.errors import ConfigError, ProfileNotFoundError, StoreError
from autobatch.profile import PROFILE_SCHEMA_VERSION, Profile

__all__ = [
    "STORE_ENV_VAR",
    "STORE_SCHEMA_VERSION",
    "ProfileStore",
    "default_store_path",
]

STORE_SCHEMA_VERSION = 1
"""Version of the table layout, kept in the file's ``PRAGMA user_version``."""

STORE_ENV_VAR = "AUTOBATCH_STORE"
"""Environment variable naming the store file; overrides the XDG cache location."""

_APPLICATION_ID = 0x41744274  # b"AtBt", in the file header: marks the file as an autobatch store
_MEMORY = ":memory:"
_DEFAULT_TIMEOUT_SECONDS = 30.0

_CREATE_SCHEMA = (
    """
    CREATE TABLE profiles (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        cache_key TEXT NOT NULL,
        model_fingerprint TEXT NOT NULL,
        device_name TEXT NOT NULL,
        created_at TEXT NOT NULL,
        profile_schema_version INTEGER NOT NULL,
        profile_json TEXT NOT NULL
    )
    """,
    "CREATE INDEX profiles_cache_key ON profiles (cache_key)",
    "CREATE INDEX profiles_model_fingerprint ON profiles (model_fingerprint)",
    "CREATE INDEX profiles_device_name ON profiles (device_name)",
    f"PRAGMA application_id = {_APPLICATION_ID}",
    f"PRAGMA user_version = {STORE_SCHEMA_VERSION}",
)
_PROFILE_COLUMNS = frozenset(
    {
        "seq",
        "id",
        "cache_key",
        "model_fingerprint",
        "device_name",
        "created_at",
        "profile_schema_version",
        "profile_json",
    }
)


def default_store_path() -> pathlib.Path:
    """Where the store lives when no path is given.

    Returns:
        ``$AUTOBATCH_STORE`` when set and non-empty (``~`` expanded), else
        ``$XDG_CACHE_HOME/autobatch/profiles.sqlite3``, where an unset, empty or relative
        ``XDG_CACHE_HOME`` means ``~/.cache`` (as the XDG base directory spec says).
    """
    explicit = os.environ.get(STORE_ENV_VAR, "")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME", "")
    if not cache_home or not os.path.isabs(cache_home):
        cache_home = str(pathlib.Path.home() / ".cache")
    return pathlib.Path(cache_home) / "autobatch" / "profiles.sqlite3"


class ProfileStore:
    """Profiles kept in one SQLite file, newest first.

    One connection per store, guarded by a lock, so one store may be shared across threads (the
    service does). Several processes may open the same file at once. "Newest" means most recently
    stored with :meth:`put`.

    Args:
        path: the SQLite file; ``None`` means :func:`default_store_path`; ``":memory:"`` keeps
            the profiles in memory (tests). Missing parent directories are created.
        timeout_seconds: how long a call waits for another process's write lock before giving
            up, in seconds.

    Raises:
        StoreError: the file cannot be opened or created (permissions, a directory in the way),
            is not an autobatch store (not SQLite, or SQLite with other tables), or was written
            by a newer autobatch. The file is left untouched in every case.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        timeout_seconds: float = _DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        self._in_memory = path is not None and os.fspath(path) == _MEMORY
        self.path = pathlib.Path(_MEMORY) if self._in_memory else _resolve(path)
        """The store's file (``Path(":memory:")`` for an in-memory store)."""
        self._lock = threading.Lock()
        if not self._in_memory:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot create the directory for the profile store {self.path}: {exc}; "
                    f"set {STORE_ENV_VAR} to a writable location"
                ) from exc
        with self._sqlite_errors("open it"):
            conn = sqlite3.connect(
                _MEMORY if self._in_memory else str(self.path),
                timeout=timeout_seconds,
                isolation_level=None,  # autocommit; writes use explicit BEGIN IMMEDIATE
                check_same_thread=False,  # shared across threads, serialised by self._lock
            )
        self._conn: sqlite3.Connection | None = conn
        try:
            with self._lock, self._sqlite_errors("open it"):
                self._open_schema(conn, timeout_seconds=timeout_seconds)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"ProfileStore({str(self.path)!r})"

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection. Idempotent; any later call raises :class:`StoreError`."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def put(self, profile: Profile) -> str:
        """Store ``profile`` under a new id.

        Args:
            profile: the profile to keep. Its ``created_at`` is indexed as given, or as the time
                of storing when empty.

        Returns:
            The new id, 16 hexadecimal characters.

        Raises:
            StoreError: the store is closed, locked longer than the timeout, or not writable.
        """
        profile_id = uuid.uuid4().hex[:16]
        created_at = profile.created_at or datetime.datetime.now(datetime.UTC).isoformat()
        row = (
            profile_id,
            profile.cache_key(),
            profile.model_fingerprint,
            profile.device_name,
            created_at,
            profile.schema_version,
            json.dumps(profile.to_dict(), sort_keys=True),
        )
        with self._write("store a profile") as conn:
            conn.execute(
                "INSERT INTO profiles (id, cache_key, model_fingerprint, device_name, created_at,"
                " profile_schema_version, profile_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            )
        return profile_id

    def get(self, profile_id: str) -> Profile:
        """The profile stored under ``profile_id``.

        Raises:
            ProfileNotFoundError: no profile has that id (also a ``KeyError``).
            StoreError: the stored profile was written by a newer autobatch or is not a valid
                profile, or the store is closed or unreadable.
        """
        with self._read("read a profile") as conn:
            row = conn.execute(
                "SELECT id, profile_json FROM profiles WHERE id = ?", (profile_id,)
            ).fetchone()
        if row is None:
            raise ProfileNotFoundError(
                f"no profile with id {profile_id!r} in {self.path}", profile_id=profile_id
            )
        return self._decode(row)[1]

    def find(self, cache_key: str) -> tuple[str, Profile] | None:
        """The newest profile stored under ``cache_key`` (see :meth:`Profile.cache_key`).

        Profiles written by a newer autobatch (a ``schema_version`` this one cannot read) are
        skipped.

        Returns:
            ``(profile_id, profile)``, or ``None`` when none matches.

        Raises:
            StoreError: the store is closed or unreadable, or the matching row is not a valid
                profile.
        """
        with self._read("find a profile") as conn:
            row = conn.execute(
                "SELECT id, profile_json FROM profiles"
                " WHERE cache_key = ? AND profile_schema_version <= ?"
                " ORDER BY seq DESC LIMIT 1",
                (cache_key, PROFILE_SCHEMA_VERSION),
            ).fetchone()
        return None if row is None else self._decode(row)

    def list_profiles(
        self,
        *,
        model_fingerprint: str | None = None,
        device_name: str | None = None,
        limit: int = 100,
    ) -> list[tuple[str, Profile]]:
        """Stored profiles, newest first.

        Profiles written by a newer autobatch are skipped.

        Args:
            model_fingerprint: only profiles of this model, when given.
            device_name: only profiles probed on this device (e.g. ``"NVIDIA H200"``), when given.
            limit: at most this many, >= 1.

        Returns:
            ``(profile_id, profile)`` pairs, newest first.

        Raises:
            ConfigError: ``limit`` is below 1.
            StoreError: the store is closed or unreadable, or a row is not a valid profile.
        """
        if limit < 1:
            raise ConfigError(f"limit {limit} must be >= 1")
        clauses = ["profile_schema_version <= ?"]
        params: list[Any] = [PROFILE_SCHEMA_VERSION]
        if model_fingerprint is not None:
            clauses.append("model_fingerprint = ?")
            params.append(model_fingerprint)
        if device_name is not None:
            clauses.append("device_name = ?")
            params.append(device_name)
        params.append(limit)
        with self._read("list profiles") as conn:
            rows = conn.execute(
                "SELECT id, profile_json FROM profiles WHERE "
                + " AND ".join(clauses)
                + " ORDER BY seq DESC LIMIT ?",
                params,
            ).fetchall()
        return [self._decode(row) for row in rows]

    def delete(self, profile_id: str) -> bool:
        """Remove the profile stored under ``profile_id``.

        Returns:
            True when a profile was removed, False when none had that id.

        Raises:
            StoreError: the store is closed, locked longer than the timeout, or not writable.
        """
        with self._write("delete a profile") as conn:
            cursor = conn.execute("DELETE FROM profiles WHERE id = ?", (profile_id,))
        return cursor.rowcount > 0

    def check_writable(self) -> None:
        """Check that a write would succeed now (for a readiness probe); writes nothing.

        Takes the write lock and makes a change that is rolled back.

        Raises:
            StoreError: the store is closed, read-only, or locked by another process for longer
                than the timeout.
        """
        with self._write("check that the store is writable") as conn:
            conn.execute(f"PRAGMA user_version = {STORE_SCHEMA_VERSION}")
            raise _Rollback

    # -- internals ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _sqlite_errors(self, doing: str) -> Iterator[None]:
        """Translate every ``sqlite3.Error`` into a :class:`StoreError` (the one place)."""
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(_describe(self.path, doing, exc)) from exc

    @contextlib.contextmanager
    def _read(self, doing: str) -> Iterator[sqlite3.Connection]:
        with self._lock, self._sqlite_errors(doing):
            yield self._connection()

    @contextlib.contextmanager
    def _write(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One short ``BEGIN IMMEDIATE`` transaction, committed unless the body raises."""
        with self._lock, self._sqlite_errors(doing):
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException as exc:
                conn.rollback()
                if isinstance(exc, _Rollback):
                    return
                raise
            conn.execute("COMMIT")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"the profile store {self.path} is closed")
        return self._conn

    def _open_schema(self, conn: sqlite3.Connection, *, timeout_seconds: float) -> None:
        """Check the file is ours and current; create the tables in an empty one.

        Reads only, unless the database is empty: a foreign, newer or corrupt file is never
        written to. Application id, schema version and tables are read in one read transaction,
        so another process creating the store at the same moment is seen either not at all or
        whole; the check repeats inside the creating write transaction, as another process may
        create the tables first.
        """
        with _transaction(conn, "BEGIN"):
            empty = self._inspect(conn)
        if empty:
            with _transaction(conn, "BEGIN IMMEDIATE"):
                if self._inspect(conn):
                    for statement in _CREATE_SCHEMA:
                        conn.execute(statement)
        if not self._in_memory:
            _use_wal(conn, timeout_seconds=timeout_seconds)

    def _inspect(self, conn: sqlite3.Connection) -> bool:
        """True when the database is empty; raise unless it is a current autobatch store."""
        application_id = conn.execute("PRAGMA application_id").fetchone()[0]
        user_version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
            ).fetchall()
        }
        if application_id == 0 and user_version == 0 and not tables:
            return True
        move_away = (
            f"move it away (or set {STORE_ENV_VAR} to another file) and autobatch will "
            "create a new store"
        )
        if application_id != _APPLICATION_ID:
            raise StoreError(
                f"{self.path} is a SQLite database but not an autobatch profile store "
                f"(tables: {', '.join(sorted(tables)) or 'none'}); {move_away}"
            )
        if user_version > STORE_SCHEMA_VERSION:
            raise StoreError(
                f"the profile store {self.path} has schema version {user_version}, newer than "
                f"this autobatch reads ({STORE_SCHEMA_VERSION}); upgrade autobatch, or set "
                f"{STORE_ENV_VAR} to another file"
            )
        columns = {row[1] for row in conn.execute("PRAGMA table_info(profiles)").fetchall()}
        missing = _PROFILE_COLUMNS - columns
        if user_version < STORE_SCHEMA_VERSION or missing:
            raise StoreError(
                f"the profile store {self.path} is damaged (schema version {user_version}, "
                f"missing columns: {', '.join(sorted(missing)) or 'none'}); {move_away}"
            )
        return False

    def _decode(self, row: tuple[str, str]) -> tuple[str, Profile]:
        profile_id, text = row
        try:
            return profile_id, Profile.from_dict(json.loads(text))
        except (ConfigError, ValueError) as exc:
            raise StoreError(
                f"cannot read profile {profile_id!r} from {self.path}: {exc}; upgrade autobatch, "
                "or delete the profile"
            ) from exc


class _Rollback(Exception):
    """Raised inside :meth:`ProfileStore._write` to end the transaction without committing."""


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    """One transaction opened with ``begin``, committed unless the body raises."""
    conn.execute(begin)
    try:
        yield
    except BaseException:
        conn.rollback()
        raise
    conn.execute("COMMIT")


def _use_wal(conn: sqlite3.Connection, *, timeout_seconds: float) -> None:
    """Switch the file to the WAL journal (kept in the file, so done once per file).

    The switch needs an exclusive lock and SQLite does not wait for one here (no busy handler):
    while other processes read the file as they open it, it fails at once with "database is
    locked". Retried until ``timeout_seconds``, as the busy timeout would.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
            return
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(random.uniform(0.001, 0.01))


def _resolve(path: str | os.PathLike[str] | None) -> pathlib.Path:
    return default_store_path() if path is None else pathlib.Path(path).expanduser()


def _describe(path: pathlib.Path, doing: str, exc: sqlite3.Error) -> str:
    """A StoreError message for a sqlite3 error: what failed, on which file, and the fix."""
    text = str(exc)
    lowered = text.lower()
    if "not a database" in lowered or "malformed" in lowered:
        fix = (
            f"the file is not a valid SQLite database; move it away (or set {STORE_ENV_VAR} to "
            "another file) and autobatch will create a new store"
        )
    elif "locked" in lowered or "busy" in lowered:
        fix = "another process holds the store's write lock; retry, or raise the timeout"
    elif "readonly" in lowered or "read-only" in lowered or "unable to open" in lowered:
        fix = (
            f"check the file's and its directory's permissions, or set {STORE_ENV_VAR} to a "
            "writable file"
        )
    else:
        fix = f"set {STORE_ENV_VAR} to another file if it persists"
    return f"profile store {path}: cannot {doing}: {text}; {fix}"
