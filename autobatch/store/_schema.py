"""The store's tables, its schema version, and the migrations that bring an older store up to it.

Why not Alembic: the store is two tables, opened in place by the library on every user's machine
(the embedded SQLite file) as well as by the fleet's service (PostgreSQL). Alembic wants a
migration environment (``env.py``, a script folder, its own ini) shipped and located at run time,
and on SQLite its ``ALTER`` support goes through batch mode (copy the table) anyway. Here a
migration is a Python function in :data:`MIGRATIONS`, keyed by the version it produces, run in
order inside one transaction that holds the store's write lock (SQLite ``BEGIN IMMEDIATE``;
PostgreSQL ``pg_advisory_xact_lock``), so two processes opening an old store at once migrate it
once, and a failure leaves it as it was (DDL is transactional on both).

The version lives in ``store_meta`` (key ``schema_version``). On SQLite it is also kept in
``PRAGMA user_version`` and the file carries ``PRAGMA application_id``, as version 1 did: a
version-1 file (no ``store_meta``) is recognised by them, and an older autobatch opening a newer
file reads the newer ``user_version`` and refuses it instead of writing to it.

Versions: 1, the first SQLite layout (``profiles`` with ``seq, id, cache_key, model_fingerprint,
device_name, created_at, profile_schema_version, profile_json``); 2 adds ``store_meta``,
``node_name`` (indexed) and the ``max_micro_batch_size``/``recommended_micro_batch_size`` that
summaries list without decoding profiles, and ``probe_jobs`` (the service's job records); 3 adds
``outbox`` (a node's profiles waiting to reach the central service, ``service.fleet.publisher``);
4 adds ``deletions`` (a tombstone per deleted profile, which nodes follow to forget their copies);
5 adds ``profiles.model_name`` (nullable: how summaries name the model, where the profile does).

Example::

    from autobatch.store._schema import open_schema

    with engine.connect() as conn:
        open_schema(conn, backend="sqlite", display="profiles.sqlite3")  # create or migrate
"""

from __future__ import annotations

import json
from collections.abc import Callable

import sqlalchemy as sa

from autobatch.errors import StoreError
from autobatch.store._location import STORE_ENV_VAR

__all__ = [
    "APPLICATION_ID",
    "MIGRATIONS",
    "STORE_SCHEMA_VERSION",
    "deletions",
    "metadata",
    "open_schema",
    "outbox",
    "probe_jobs",
    "profiles",
    "store_meta",
]

STORE_SCHEMA_VERSION = 5
"""Version of the table layout this autobatch reads and writes."""

APPLICATION_ID = 0x41744274  # b"AtBt", in a SQLite file's header: marks the file as ours
_PG_LOCK_KEY = 0x41744274  # pg_advisory_xact_lock key held while creating or migrating
PG_PROFILES_LOCK_KEY = 0x41744275
"""pg_advisory_xact_lock key a transaction takes before it inserts profiles: held to its commit,
it makes ``profiles.seq`` (drawn after it) follow commit order (``ProfileStore.page_profiles``'s
``after`` cursor)."""

metadata = sa.MetaData()

profiles = sa.Table(
    "profiles",
    metadata,
    # INTEGER PRIMARY KEY is the rowid on SQLite (version 1's column); BIGINT identity elsewhere
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("id", sa.Text(), nullable=False, unique=True),
    sa.Column("cache_key", sa.Text(), nullable=False, index=True),
    sa.Column("model_fingerprint", sa.Text(), nullable=False, index=True),
    sa.Column("device_name", sa.Text(), nullable=False, index=True),
    sa.Column("node_name", sa.Text(), nullable=False, server_default="", index=True),
    sa.Column("created_at", sa.Text(), nullable=False),
    sa.Column("profile_schema_version", sa.Integer(), nullable=False),
    sa.Column("max_micro_batch_size", sa.Integer(), nullable=True),
    sa.Column("recommended_micro_batch_size", sa.Integer(), nullable=True),
    sa.Column("model_name", sa.Text(), nullable=True),
    sa.Column("profile_json", sa.Text(), nullable=False),
)
"""One row per stored profile; ``seq`` orders them (newest last)."""

store_meta = sa.Table(
    "store_meta",
    metadata,
    sa.Column("key", sa.Text(), primary_key=True),
    sa.Column("value", sa.Text(), nullable=False),
)
"""Facts about the store itself: ``schema_version``."""

probe_jobs = sa.Table(
    "probe_jobs",
    metadata,
    sa.Column("id", sa.Text(), primary_key=True),
    sa.Column("updated_at", sa.Text(), nullable=False),
    sa.Column("job_json", sa.Text(), nullable=False),
)
"""The service's probe runs (:mod:`autobatch.store._probe_runs`), so that a restarted server
still answers a known run id; the table keeps the name it has had since version 2 (a rename
would take a migration that every older autobatch sharing the store would refuse)."""

outbox = sa.Table(
    "outbox",
    metadata,
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("profile_id", sa.Text(), nullable=False, unique=True),
    sa.Column("enqueued_at", sa.Float(), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("last_attempt_at", sa.Float(), nullable=True),
    sa.Column("next_attempt_at", sa.Float(), nullable=False, index=True),
    sa.Column("last_error", sa.Text(), nullable=False, server_default=""),
)
"""A node's profiles not yet acknowledged by the central service (``autobatch.store._outbox``);
times are Unix seconds, as they must survive a restart. ``seq`` orders them (oldest first)."""

deletions = sa.Table(
    "deletions",
    metadata,
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("profile_id", sa.Text(), nullable=False, index=True),
    sa.Column("deleted_at", sa.Text(), nullable=False),
)
"""One tombstone per deleted profile, kept (a few dozen bytes each): ``seq``, the cursor that
nodes follow (``ProfileStore.page_deletions``), drawn in commit order as ``profiles.seq`` is
(the same insert lock on PostgreSQL; rows never deleted, so never reused on SQLite)."""

_V1_COLUMNS = frozenset(
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


_ADDED_IN = {"model_name": 5}
"""``profiles`` columns added after version 2, by the version that added them (a store of an
older version lacks them until migrated, and is not damaged for that)."""


def _to_v2(conn: sa.Connection, backend: str) -> None:
    """Version 1 -> 2: ``store_meta`` and ``probe_jobs``; ``node_name`` and the micro-batch
    columns, filled in from each row's JSON (a row that does not decode keeps ``''``/NULL:
    listings skip it)."""
    store_meta.create(conn)
    probe_jobs.create(conn)
    for ddl in (
        "ALTER TABLE profiles ADD COLUMN node_name TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE profiles ADD COLUMN max_micro_batch_size INTEGER",
        "ALTER TABLE profiles ADD COLUMN recommended_micro_batch_size INTEGER",
    ):
        conn.exec_driver_sql(ddl)
    for index in profiles.indexes:
        if index.name == "ix_profiles_node_name":
            index.create(conn)
    rows = conn.execute(sa.select(profiles.c.seq, profiles.c.profile_json)).all()
    for seq, text in rows:
        try:
            data = json.loads(text)
            values = {
                "node_name": str(data.get("node_name") or ""),
                "max_micro_batch_size": int(data["max_micro_batch_size"]),
                "recommended_micro_batch_size": int(data["recommended_micro_batch_size"]),
            }
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        conn.execute(sa.update(profiles).where(profiles.c.seq == seq).values(**values))


def _to_v3(conn: sa.Connection, backend: str) -> None:
    """Version 2 -> 3: the ``outbox`` table (empty)."""
    outbox.create(conn)


def _to_v4(conn: sa.Connection, backend: str) -> None:
    """Version 3 -> 4: the ``deletions`` table (empty: what was deleted before is not known)."""
    deletions.create(conn)


def _to_v5(conn: sa.Connection, backend: str) -> None:
    """Version 4 -> 5: ``profiles.model_name``, NULL for the profiles already stored (written
    before profiles named their model, profile schema 4, which only a version-5 store holds)."""
    conn.exec_driver_sql("ALTER TABLE profiles ADD COLUMN model_name TEXT")


MIGRATIONS: dict[int, Callable[[sa.Connection, str], None]] = {
    2: _to_v2,
    3: _to_v3,
    4: _to_v4,
    5: _to_v5,
}
"""``{version: function}``: the function takes a store at ``version - 1`` to ``version``."""


def open_schema(conn: sa.Connection, *, backend: str, display: str) -> None:
    """Check the database is a current store; create it when empty, migrate it when older.

    Reads only unless there is something to create or migrate: a foreign, newer or damaged
    database is never written to. The check repeats inside the write transaction (under the
    store's write lock), as another process may create or migrate the store first.

    Args:
        conn: a connection with no transaction begun.
        backend: ``"sqlite"`` or ``"postgresql"``.
        display: the store's location as it may be shown (no password).

    Raises:
        StoreError: the database is not an autobatch store, was written by a newer autobatch,
            or is damaged. Nothing was changed.
    """
    with conn.begin():
        version = _inspect(conn, backend=backend, display=display)
    if version == STORE_SCHEMA_VERSION:
        return
    with conn.execution_options(autobatch_write=True).begin():
        if backend == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_LOCK_KEY)))
        version = _inspect(conn, backend=backend, display=display)
        if version == 0:
            metadata.create_all(conn)
        else:
            for target in range(version + 1, STORE_SCHEMA_VERSION + 1):
                MIGRATIONS[target](conn, backend)
        if version != STORE_SCHEMA_VERSION:
            _record_version(conn, backend=backend, fresh=version == 0)


def _record_version(conn: sa.Connection, *, backend: str, fresh: bool) -> None:
    conn.execute(sa.delete(store_meta).where(store_meta.c.key == "schema_version"))
    conn.execute(
        sa.insert(store_meta).values(key="schema_version", value=str(STORE_SCHEMA_VERSION))
    )
    if backend == "sqlite":
        if fresh:
            conn.exec_driver_sql(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.exec_driver_sql(f"PRAGMA user_version = {STORE_SCHEMA_VERSION}")


def _inspect(conn: sa.Connection, *, backend: str, display: str) -> int:
    """The store's schema version; 0 for an empty database. Raises unless it is ours and not
    newer than this autobatch."""
    tables = set(sa.inspect(conn).get_table_names())
    move_away = (
        f"move it away (or set {STORE_ENV_VAR} to another location) and autobatch will "
        "create a new store"
    )
    if backend == "sqlite":
        application_id = conn.exec_driver_sql("PRAGMA application_id").scalar_one()
        user_version = conn.exec_driver_sql("PRAGMA user_version").scalar_one()
        if application_id == 0 and user_version == 0 and not tables:
            return 0
        if application_id != APPLICATION_ID:
            raise StoreError(
                f"{display} is a SQLite database but not an autobatch profile store "
                f"(tables: {', '.join(sorted(tables)) or 'none'}); {move_away}"
            )
        version = int(user_version)
    else:
        if "profiles" not in tables and "store_meta" not in tables:
            return 0  # a database may hold other applications' tables beside ours
        version = -1
    if "store_meta" in tables:
        value = conn.execute(
            sa.select(store_meta.c.value).where(store_meta.c.key == "schema_version")
        ).scalar_one_or_none()
        recorded = int(value) if value is not None and value.isdigit() else -1
        version = max(version, recorded) if recorded >= 0 else recorded
    if version > STORE_SCHEMA_VERSION:
        raise StoreError(
            f"the profile store {display} has schema version {version}, newer than this "
            f"autobatch reads ({STORE_SCHEMA_VERSION}); upgrade autobatch, or set "
            f"{STORE_ENV_VAR} to another location"
        )
    columns = (
        {column["name"] for column in sa.inspect(conn).get_columns("profiles")}
        if "profiles" in tables
        else set()
    )
    expected = (
        _V1_COLUMNS
        if version == 1
        else {c.name for c in profiles.columns if _ADDED_IN.get(c.name, 2) <= version}
    )
    missing = expected - columns
    if version < 1 or missing:
        raise StoreError(
            f"the profile store {display} is damaged (schema version {version}, missing "
            f"columns: {', '.join(sorted(missing)) or 'none'}); {move_away}"
        )
    return version
