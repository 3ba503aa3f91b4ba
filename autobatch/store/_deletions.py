"""Deleting profiles, and the tombstones that say so: what a store forgets, its followers can
forget too.

Every profile removed (:meth:`ProfileStore.delete`, :meth:`ProfileStore.forget`) leaves a row in
``deletions`` in the same transaction: its id, when, and a ``seq`` cursor drawn in commit
order (on PostgreSQL under the insert lock of ``autobatch.store._sequence``, held to the
commit). A node follows a central store's tombstones (:func:`page_deletions` from cursor 0, then
each page's ``next_after``) and deletes its copies of those ids (``service.fleet.forgetting``).
Tombstones are kept: a few dozen bytes per deleted profile. A tombstoned id is never stored
again (``autobatch.store._publishing``): a resend of a deleted profile (a node outbox's retry)
or a copy fetched before the deletion and stored after it stays deleted; a node following
another store's deletions tombstones the ids it does not hold too (``absent_too``).

Example::

    removed = delete_ids(db, "sqlite", ["9f2c0a1b2c3d4e5f"])   # ['9f2c0a1b2c3d4e5f'] or []
    page = page_deletions(db, after=0, limit=100)               # oldest first
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable

from autobatch.errors import ConfigError
from autobatch.store._connection import StoreConnection

# SQLAlchemy is imported when a function here is called, so that importing the store stays
# SQLAlchemy-free (``autobatch.store._store``).

__all__ = ["Deletion", "DeletionPage", "delete_ids", "page_deletions"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Deletion:
    """One tombstone: a profile this store deleted."""

    profile_id: str
    deleted_at: str
    """ISO 8601 time of the deletion (UTC)."""
    cursor: int
    """Its place among deletions, in commit order."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeletionPage:
    """One page of :meth:`ProfileStore.page_deletions`, oldest first."""

    deletions: tuple[Deletion, ...]
    next_after: int
    """The cursor to ask with next (the same one when nothing was deleted since)."""


def delete_ids(
    db: StoreConnection, backend: str, profile_ids: Iterable[str], *, absent_too: bool = False
) -> list[str]:
    """Delete the profiles of ``profile_ids`` that the store holds, in one transaction, each
    leaving a tombstone; the ids removed, in the order given. With ``absent_too``, the ids the
    store does not hold get a tombstone too (once), so that they are never stored after
    (``autobatch.store._publishing.insert_profile`` refuses a tombstoned id).

    Raises:
        StoreError: the store is closed, locked longer than the timeout, or not writable.
    """
    import sqlalchemy as sa

    from autobatch.store._publishing import is_deleted
    from autobatch.store._schema import deletions, profiles
    from autobatch.store._sequence import lock_for_insert, remember_deleted

    removed = []
    now = datetime.datetime.now(datetime.UTC).isoformat()
    with db.write("delete profiles") as conn:
        lock_for_insert(conn, backend)  # tombstones' seq in commit order, like profiles'
        for profile_id in dict.fromkeys(profile_ids):
            remember_deleted(conn, backend, profile_id)
            done = conn.execute(sa.delete(profiles).where(profiles.c.id == profile_id))
            if done.rowcount > 0:
                removed.append(profile_id)
            elif not absent_too or is_deleted(conn, profile_id):
                continue
            conn.execute(sa.insert(deletions).values(profile_id=profile_id, deleted_at=now))
    return removed


def page_deletions(db: StoreConnection, *, after: int, limit: int) -> DeletionPage:
    """The tombstones after cursor ``after`` (0: from the first), oldest first, at most
    ``limit``.

    Raises:
        ConfigError: ``after`` is negative or ``limit`` below 1.
        StoreError: the store is closed or unreadable.
    """
    import sqlalchemy as sa

    from autobatch.store._schema import deletions

    if after < 0 or limit < 1:
        raise ConfigError(
            f"after {after} must be a cursor >= 0 (0: from the first deletion) and limit "
            f"{limit} >= 1"
        )
    query = (
        sa.select(deletions.c.seq, deletions.c.profile_id, deletions.c.deleted_at)
        .where(deletions.c.seq > after)
        .order_by(deletions.c.seq)
        .limit(limit)
    )
    with db.read("list deletions") as conn:
        rows = conn.execute(query).all()
    found = tuple(
        Deletion(profile_id=row.profile_id, deleted_at=row.deleted_at, cursor=row.seq)
        for row in rows
    )
    return DeletionPage(deletions=found, next_after=found[-1].cursor if found else after)
