"""The records of the service's probe runs (a probe of a registered model, ``POST
/v1/probes``) in the store, so that a restarted server still answers a known run id. Part of
the store (:meth:`ProfileStore.put_probe_run`, :meth:`ProfileStore.get_probe_run`), split off
to keep that module to its profiles.

The SQL table keeps its name, ``probe_jobs`` (column ``job_json``), from the store's schema
version 2: renaming it would take a schema migration, and a store at a newer version is refused
by every older autobatch that shares it (a fleet's PostgreSQL store), for no change in what it
holds.

Example::

    put_probe_run(store_connection, "sqlite", "3f2a...", {"id": "3f2a...", "status": "queued"})
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autobatch.errors import StoreError

# _engine and _schema import SQLAlchemy: the functions here import them when
# called, so that importing the store (``from autobatch import ProfileStore``) stays
# SQLAlchemy-free.

if TYPE_CHECKING:
    from autobatch.store._connection import StoreConnection

__all__ = ["get_probe_run", "put_probe_run"]


def put_probe_run(
    db: StoreConnection, backend: str, run_id: str, record: Mapping[str, Any]
) -> None:
    """Keep (or replace) the record of the service's probe run ``run_id``.

    Args:
        run_id: the run's id.
        record: its state, JSON-ready.

    Raises:
        StoreError: the store is closed, locked longer than the timeout, or not writable.
    """
    from autobatch.store._engine import insert
    from autobatch.store._schema import probe_jobs

    values = {
        "id": run_id,
        "updated_at": datetime.datetime.now(datetime.UTC).isoformat(),
        "job_json": json.dumps(dict(record), sort_keys=True),
    }
    statement = insert(backend, probe_jobs).values(**values)
    statement = statement.on_conflict_do_update(
        index_elements=["id"],
        set_={"updated_at": values["updated_at"], "job_json": values["job_json"]},
    )
    with db.write("store a probe run") as conn:
        conn.execute(statement)


def get_probe_run(db: StoreConnection, run_id: str) -> dict[str, Any] | None:
    """The record kept by :func:`put_probe_run` for ``run_id``; None when there is none.

    Raises:
        StoreError: the store is closed or unreadable, or the record does not decode.
    """
    import sqlalchemy as sa

    from autobatch.store._schema import probe_jobs

    query = sa.select(probe_jobs.c.job_json).where(probe_jobs.c.id == run_id)
    with db.read("read a probe run") as conn:
        text = conn.execute(query).scalar_one_or_none()
    if text is None:
        return None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise StoreError(f"cannot read probe run {run_id!r} from {db.display}: {exc}") from exc
    if not isinstance(record, dict):
        raise StoreError(f"cannot read probe run {run_id!r} from {db.display}: not a record")
    return record
