"""The query a fleet's plan by card reads: each node's latest profile of a model per thing it
measured. SQLAlchemy Core, the same statement on SQLite and PostgreSQL.

However often a node publishes, it holds one row per cache key (card, step, conditions) in the
answer, so a flood of one node's profiles pushes no other node's out, and the cost of a plan by
card grows with the nodes and what they measured, not with the store's history.

Example::

    rows = latest_rows(db, model_fingerprint="fp", limit=1000)   # (id, device_name, json)
"""

from __future__ import annotations

import sqlalchemy as sa

from autobatch.profile import PROFILE_SCHEMA_VERSION
from autobatch.store._connection import StoreConnection
from autobatch.store._schema import profiles

__all__ = ["latest_rows"]


def latest_rows(
    db: StoreConnection, *, model_fingerprint: str, limit: int
) -> list[tuple[str, str, str]]:
    """``(id, device_name, profile_json)`` of the newest row of each ``(node_name, cache_key)``
    among the model's rows, newest first, at most ``limit``; rows written by a newer autobatch
    are left out. One statement: the newest ``seq`` of each group, then those rows."""
    latest = (
        sa.select(sa.func.max(profiles.c.seq))
        .where(profiles.c.model_fingerprint == model_fingerprint)
        .where(profiles.c.profile_schema_version <= PROFILE_SCHEMA_VERSION)
        .group_by(profiles.c.node_name, profiles.c.cache_key)
    )
    query = (
        sa.select(profiles.c.id, profiles.c.device_name, profiles.c.profile_json)
        .where(profiles.c.seq.in_(latest.scalar_subquery()))
        .order_by(profiles.c.seq.desc())
        .limit(limit)
    )
    with db.read("list each node's latest profiles") as conn:
        return [(row[0], row[1], row[2]) for row in conn.execute(query)]
