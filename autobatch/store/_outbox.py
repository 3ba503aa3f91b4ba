"""A node's outbox: the profiles its store holds that the central service has not yet
acknowledged, with when each was tried and when it is tried next.

The rows live in the node's own store (table ``outbox``, :mod:`autobatch.store._schema`), so a
restart of the node loses none: the sender (``service.fleet.publisher``) resumes from them. A
row names a stored profile by id; the profile's JSON is read from ``profiles`` when it is sent.
The outbox is bounded: :meth:`Outbox.enqueue` drops the oldest rows beyond ``max_rows`` in the
same transaction, and returns them so the caller can say what it dropped. Times are Unix seconds.
Imports neither torch nor pynvml; SQLAlchemy is imported on first use.

Example::

    dropped = store.outbox.enqueue(profile_id, now=time.time(), max_rows=10_000)
    entry = store.outbox.earliest()            # the next to send, with its profile's JSON
    store.outbox.remove(entry.profile_id)      # acknowledged by the central service
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from autobatch.errors import ConfigError

# _engine and _schema import SQLAlchemy: the functions here import them when
# called, so that importing the store (``from autobatch import ProfileStore``) stays
# SQLAlchemy-free.

if TYPE_CHECKING:
    from autobatch.store._connection import StoreConnection

__all__ = ["Outbox", "OutboxEntry"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OutboxEntry:
    """One profile waiting for the central service's acknowledgement."""

    profile_id: str
    enqueued_at: float
    """When it entered the outbox, Unix seconds."""
    attempts: int
    """Sends tried so far that were not acknowledged."""
    last_attempt_at: float | None
    """When the last of them was tried, Unix seconds; None before the first."""
    next_attempt_at: float
    """Not sent again before this, Unix seconds."""
    last_error: str
    """Why the last try failed; ``""`` before the first."""
    profile_json: str | None = None
    """The profile as stored (filled in by :meth:`Outbox.earliest`); None when the profile is
    no longer in the store."""


class Outbox:
    """The ``outbox`` table of one store (``ProfileStore.outbox``); thread-safe as the store is.

    Args:
        db: the store's connection.
        backend: ``"sqlite"`` or ``"postgresql"``.
    """

    def __init__(self, db: StoreConnection, backend: str) -> None:
        self._db = db
        self._backend = backend

    def enqueue(self, profile_id: str, *, now: float, max_rows: int) -> list[OutboxEntry]:
        """Add ``profile_id`` (due at once), unless it already waits; then keep at most
        ``max_rows`` rows by deleting the oldest, in the same transaction.

        Args:
            profile_id: a profile stored in this store.
            now: the time, Unix seconds.
            max_rows: the outbox's bound, >= 1.

        Returns:
            The rows dropped to make room, oldest first (empty while under the bound).

        Raises:
            ConfigError: ``max_rows`` is below 1.
            StoreError: the store is closed, locked longer than its timeout, or not writable.
        """
        import sqlalchemy as sa

        from autobatch.store._engine import insert
        from autobatch.store._schema import outbox

        if max_rows < 1:
            raise ConfigError(f"max_rows {max_rows} must be >= 1 (the outbox's bound, in rows)")
        row = {"profile_id": profile_id, "enqueued_at": now, "next_attempt_at": now}
        statement = insert(self._backend, outbox).values(**row)
        with self._db.write("queue a profile to publish") as conn:
            conn.execute(statement.on_conflict_do_nothing(index_elements=["profile_id"]))
            count = conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar_one()
            if count <= max_rows:
                return []
            oldest = conn.execute(
                sa.select(*_columns()).order_by(outbox.c.seq).limit(count - max_rows)
            ).all()
            dropped = [_entry(row) for row in oldest]
            ids = [entry.profile_id for entry in dropped]
            conn.execute(sa.delete(outbox).where(outbox.c.profile_id.in_(ids)))
        return dropped

    def earliest(self) -> OutboxEntry | None:
        """The row with the earliest ``next_attempt_at`` (the oldest among equals), with its
        profile's JSON; None when the outbox is empty.

        Raises:
            StoreError: the store is closed or unreadable.
        """
        import sqlalchemy as sa

        from autobatch.store._schema import outbox, profiles

        query = (
            sa.select(*_columns(), profiles.c.profile_json)
            .select_from(outbox.outerjoin(profiles, profiles.c.id == outbox.c.profile_id))
            .order_by(outbox.c.next_attempt_at, outbox.c.seq)
            .limit(1)
        )
        with self._db.read("read the outbox") as conn:
            row = conn.execute(query).first()
        return None if row is None else _entry(row, profile_json=row.profile_json)

    def entries(self) -> list[OutboxEntry]:
        """Every row, oldest first, without the profiles' JSON.

        Raises:
            StoreError: the store is closed or unreadable.
        """
        import sqlalchemy as sa

        from autobatch.store._schema import outbox

        with self._db.read("read the outbox") as conn:
            rows = conn.execute(sa.select(*_columns()).order_by(outbox.c.seq)).all()
        return [_entry(row) for row in rows]

    def count(self) -> int:
        """Rows waiting.

        Raises:
            StoreError: the store is closed or unreadable.
        """
        import sqlalchemy as sa

        from autobatch.store._schema import outbox

        with self._db.read("count the outbox") as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar_one())

    def retry_later(
        self, profile_id: str, *, attempted_at: float, next_attempt_at: float, error: str
    ) -> None:
        """Record a try of ``profile_id`` that was not acknowledged, and when to try again.

        Args:
            profile_id: the row's profile.
            attempted_at: when the try was made, Unix seconds.
            next_attempt_at: not before this, Unix seconds.
            error: why it failed (kept to 500 characters).

        Raises:
            StoreError: the store is closed, locked longer than its timeout, or not writable.
        """
        import sqlalchemy as sa

        from autobatch.store._schema import outbox

        statement = (
            sa.update(outbox)
            .where(outbox.c.profile_id == profile_id)
            .values(
                attempts=outbox.c.attempts + 1,
                last_attempt_at=attempted_at,
                next_attempt_at=next_attempt_at,
                last_error=error[:500],
            )
        )
        with self._db.write("reschedule a profile to publish") as conn:
            conn.execute(statement)

    def remove(self, profile_id: str) -> bool:
        """Take ``profile_id`` out (acknowledged, or refused for good).

        Returns:
            True when it was there.

        Raises:
            StoreError: the store is closed, locked longer than its timeout, or not writable.
        """
        import sqlalchemy as sa

        from autobatch.store._schema import outbox

        with self._db.write("remove a published profile from the outbox") as conn:
            done = conn.execute(sa.delete(outbox).where(outbox.c.profile_id == profile_id))
        return done.rowcount > 0


def _columns() -> list[Any]:
    from autobatch.store._schema import outbox

    return [outbox.c[field.name] for field in dataclasses.fields(OutboxEntry)[:-1]]


def _entry(row: Any, *, profile_json: str | None = None) -> OutboxEntry:
    names = [field.name for field in dataclasses.fields(OutboxEntry)[:-1]]
    values = {name: getattr(row, name) for name in names}
    return OutboxEntry(**values, profile_json=profile_json)
