"""``profiles.seq`` in commit order, never reused: what the follow cursor
(``ProfileStore.page_profiles(after=...)``) stands on.

PostgreSQL draws ``seq`` from an identity sequence when the row is inserted, not when it
commits: two writers may commit 6 before 5, and a follower that saw 6 would never see 5. A
writer therefore takes a transaction-scoped advisory lock before its insert
(:func:`lock_for_insert`) and holds it to its commit, so ``seq`` order is commit order.
SQLite serialises its writers already, but an ``INTEGER PRIMARY KEY`` without
``AUTOINCREMENT`` reuses the largest ``seq`` once that row is deleted; a delete records the
largest ``seq`` it removed in ``store_meta`` (:func:`remember_deleted`), and an insert draws
above it (:func:`next_sqlite_seq`).

Example::

    with db.write("store a profile") as conn:
        lock_for_insert(conn, backend)
        conn.execute(insert(profiles).values(seq=next_sqlite_seq(), ...))   # SQLite
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from autobatch.store._schema import PG_PROFILES_LOCK_KEY, profiles, store_meta

__all__ = ["lock_for_insert", "next_sqlite_seq", "remember_deleted"]

_FLOOR_KEY = "deleted_seq_floor"


def lock_for_insert(conn: sa.Connection, backend: str) -> None:
    """On PostgreSQL, take the profiles' insert lock to the end of the transaction."""
    if backend == "postgresql":
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(PG_PROFILES_LOCK_KEY)))


def next_sqlite_seq() -> Any:
    """The SQL value of a new row's ``seq`` on SQLite: above every row and every deleted one."""
    top = sa.select(sa.func.max(profiles.c.seq)).scalar_subquery()
    floor = (
        sa.select(sa.cast(store_meta.c.value, sa.Integer))
        .where(store_meta.c.key == _FLOOR_KEY)
        .scalar_subquery()
    )
    return sa.func.max(sa.func.coalesce(top, 0), sa.func.coalesce(floor, 0)) + 1


def remember_deleted(conn: sa.Connection, backend: str, profile_id: str) -> None:
    """On SQLite, before deleting ``profile_id``: keep the largest ``seq`` ever deleted."""
    if backend != "sqlite":
        return
    seq = conn.execute(
        sa.select(profiles.c.seq).where(profiles.c.id == profile_id)
    ).scalar_one_or_none()
    if seq is None:
        return
    floor = conn.execute(
        sa.select(store_meta.c.value).where(store_meta.c.key == _FLOOR_KEY)
    ).scalar_one_or_none()
    if floor is None:
        conn.execute(sa.insert(store_meta).values(key=_FLOOR_KEY, value=str(seq)))
    elif int(floor) < seq:
        conn.execute(
            sa.update(store_meta).where(store_meta.c.key == _FLOOR_KEY).values(value=str(seq))
        )
