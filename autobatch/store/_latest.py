"""The query a fleet's plan by card reads: each node's latest profile of a model per thing it
measured. SQLAlchemy Core, the same statement on SQLite and PostgreSQL.

However often a node publishes, it holds one row per cache key (card, step, conditions) in the
answer, and at most :data:`PER_NODE_KEYS` of them (its newest), so neither a flood of one node's
profiles nor a flood of things it claims to have measured (a new card name or condition each
time) pushes another node's out of the answer's ``limit``; the cost of a plan by card grows with
the nodes and what they measured, not with the store's history.

Example::

    rows = latest_rows(db, model_fingerprint="fp", limit=1000)   # (id, device_name, json)
"""

from __future__ import annotations

import sqlalchemy as sa

from autobatch.profile import PROFILE_SCHEMA_VERSION
from autobatch.store._connection import StoreConnection
from autobatch.store._schema import profiles

__all__ = ["PER_NODE_KEYS", "latest_rows"]

PER_NODE_KEYS = 32
"""Things (cache keys) one node holds at most in the answer, its newest: more than a node
measures of one model in earnest (a few cards' names, precisions, optimizers and checkpointing
modes), few enough that a node inventing a new one with each profile fills at most 32 rows of
the answer's ``limit`` (1000 for a plan)."""


def latest_rows(
    db: StoreConnection, *, model_fingerprint: str, limit: int, per_node: int = PER_NODE_KEYS
) -> list[tuple[str, str, str]]:
    """``(id, device_name, profile_json)`` of the newest row of each ``(node_name, cache_key)``
    among the model's rows, at most ``per_node`` of each node (its newest), newest first, at
    most ``limit``; rows written by a newer autobatch are left out. One statement: the newest
    ``seq`` of each group, numbered within its node, then those rows."""
    latest = (
        sa.select(sa.func.max(profiles.c.seq).label("seq"), profiles.c.node_name)
        .where(profiles.c.model_fingerprint == model_fingerprint)
        .where(profiles.c.profile_schema_version <= PROFILE_SCHEMA_VERSION)
        .group_by(profiles.c.node_name, profiles.c.cache_key)
        .subquery()
    )
    numbered = sa.select(
        latest.c.seq,
        sa.func.row_number()
        .over(partition_by=latest.c.node_name, order_by=latest.c.seq.desc())
        .label("newest"),
    ).subquery()
    kept = sa.select(numbered.c.seq).where(numbered.c.newest <= per_node)
    query = (
        sa.select(profiles.c.id, profiles.c.device_name, profiles.c.profile_json)
        .where(profiles.c.seq.in_(kept.scalar_subquery()))
        .order_by(profiles.c.seq.desc())
        .limit(limit)
    )
    with db.read("list each node's latest profiles") as conn:
        return [(row[0], row[1], row[2]) for row in conn.execute(query)]
