"""Copying a store's profiles into another (:meth:`ProfileStore.copy_into`): oldest first, ids
kept, in batches, skipping what the target already holds and what it cannot store.

Example::

    num_copied = ProfileStore("old.sqlite3").copy_into(ProfileStore("postgresql://db/fleet"))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from autobatch.errors import ConfigError
from autobatch.store._connection import StoreConnection
from autobatch.store._storable import unstorable_in

# _engine, _schema and _sequence import SQLAlchemy: the functions here import them when
# called, so that importing the store (``from autobatch import ProfileStore``) stays
# SQLAlchemy-free.

if TYPE_CHECKING:
    from autobatch.store._store import ProfileStore

__all__ = ["copy_rows"]

_log = logging.getLogger("autobatch.store")


def copy_rows(
    source: StoreConnection,
    target_db: StoreConnection,
    target: ProfileStore,
    *,
    batch_size: int,
    on_uncopied: Callable[[str, str], None] | None,
) -> int:
    """The rows of ``source`` copied into ``target`` (whose connection is ``target_db``), as
    :meth:`ProfileStore.copy_into` says; the number new to ``target``.

    Raises:
        ConfigError: ``batch_size`` is below 1.
        StoreError: either store is closed, unreadable or not writable.
    """
    import sqlalchemy as sa

    from autobatch.store._engine import insert
    from autobatch.store._schema import profiles
    from autobatch.store._sequence import lock_for_insert

    if batch_size < 1:
        raise ConfigError(f"batch_size {batch_size} must be >= 1")
    columns = [column for column in profiles.columns if column.name != "seq"]
    last_seq, num_copied = -1, 0
    while True:
        with source.read("read profiles to copy") as conn:
            rows = conn.execute(
                sa.select(profiles.c.seq, *columns)
                .where(profiles.c.seq > last_seq)
                .order_by(profiles.c.seq)
                .limit(batch_size)
            ).all()
        if not rows:
            return num_copied
        last_seq = rows[-1].seq
        values = []
        for row in rows:
            value = {c.name: getattr(row, c.name) for c in columns}
            why = unstorable_in(value)
            if why is None:
                values.append(value)
                continue
            _log.warning("profile %s not copied to %s: %s", row.id, target.location, why)
            if on_uncopied is not None:
                on_uncopied(row.id, why)
        if not values:
            continue
        with target_db.write("copy profiles in") as conn:
            lock_for_insert(conn, target.backend)
            statement = insert(target.backend, profiles).values(values)
            statement = statement.on_conflict_do_nothing(index_elements=["id"])
            # rows inserted, counted by RETURNING (a multi-row rowcount is not portable)
            num_copied += len(conn.execute(statement.returning(profiles.c.id)).all())
