"""The service's probe job records in the store (table ``probe_jobs``), so that a restarted
server still answers a known job id. Part of the store (:class:`ProfileStore.put_job`,
:class:`ProfileStore.get_job`), split off to keep that module to its profiles.

Example::

    put_job(store_connection, "sqlite", "3f2a...", {"id": "3f2a...", "status": "queued"})
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

__all__ = ["get_job", "put_job"]


def put_job(db: StoreConnection, backend: str, job_id: str, record: Mapping[str, Any]) -> None:
    """Keep (or replace) the record of the service's probe job ``job_id``.

    Args:
        job_id: the job's id.
        record: its state, JSON-ready.

    Raises:
        StoreError: the store is closed, locked longer than the timeout, or not writable.
    """
    from autobatch.store._engine import insert
    from autobatch.store._schema import probe_jobs

    values = {
        "id": job_id,
        "updated_at": datetime.datetime.now(datetime.UTC).isoformat(),
        "job_json": json.dumps(dict(record), sort_keys=True),
    }
    statement = insert(backend, probe_jobs).values(**values)
    statement = statement.on_conflict_do_update(
        index_elements=["id"],
        set_={"updated_at": values["updated_at"], "job_json": values["job_json"]},
    )
    with db.write("store a probe job") as conn:
        conn.execute(statement)


def get_job(db: StoreConnection, job_id: str) -> dict[str, Any] | None:
    """The record kept by :func:`put_job` for ``job_id``; None when there is none.

    Raises:
        StoreError: the store is closed or unreadable, or the record does not decode.
    """
    import sqlalchemy as sa

    from autobatch.store._schema import probe_jobs

    query = sa.select(probe_jobs.c.job_json).where(probe_jobs.c.id == job_id)
    with db.read("read a probe job") as conn:
        text = conn.execute(query).scalar_one_or_none()
    if text is None:
        return None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise StoreError(f"cannot read probe job {job_id!r} from {db.display}: {exc}") from exc
    if not isinstance(record, dict):
        raise StoreError(f"cannot read probe job {job_id!r} from {db.display}: not a record")
    return record
