"""Storing a profile, once however often it is sent.

A profile's id is the hash of its canonical JSON, so storing the same profile again is a no-op
(``INSERT ... ON CONFLICT DO NOTHING`` on the id). A profile sent without ``created_at`` is
stamped with the time it arrives, which would give each resend (a publisher's retry after an
answer it never read) a new id; :func:`find_resent` finds the stored profile it repeats: the
same canonical JSON but for ``created_at``, among the rows of its ``cache_key`` (indexed). The
caller looks it up and inserts in one write transaction under the profiles' insert lock
(SQLite's write lock; PostgreSQL's advisory lock), so concurrent resends store one row on
either backend.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any

import sqlalchemy as sa

from autobatch.errors import ProfileDeletedError, StoreError
from autobatch.profile import Profile
from autobatch.store._engine import insert
from autobatch.store._schema import deletions, profiles
from autobatch.store._sequence import lock_for_insert, next_sqlite_seq

__all__ = ["canonical", "find_resent", "insert_profile", "is_deleted"]


def canonical(profile: Profile) -> str:
    """``profile``'s canonical JSON (sorted keys, no spaces): what its id hashes."""
    return _dumps(profile.to_dict())


def _dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def insert_profile(
    conn: sa.Connection, backend: str, profile: Profile, *, display: str
) -> tuple[str, bool]:
    """Insert ``profile`` in the caller's write transaction.

    Returns:
        Its id (16 hexadecimal characters of its canonical JSON's SHA-256) and whether this
        call stored it (False: it was stored already).

    Raises:
        ProfileDeletedError: the store deleted the profile of this id (its tombstone is kept):
            a resend or a copy fetched before the deletion is not stored again.
        StoreError: the id already holds another profile (a hash collision).
    """
    text = canonical(profile)
    profile_id = hashlib.sha256(text.encode()).hexdigest()[:16]
    row: dict[str, Any] = {
        "id": profile_id,
        "cache_key": profile.cache_key(),
        "model_fingerprint": profile.model_fingerprint,
        "device_name": profile.device_name,
        "node_name": profile.node_name,
        "model_name": profile.model_name or None,
        "created_at": profile.created_at or datetime.datetime.now(datetime.UTC).isoformat(),
        "profile_schema_version": profile.schema_version,
        "max_micro_batch_size": profile.max_micro_batch_size,
        "recommended_micro_batch_size": profile.recommended_micro_batch_size,
        "profile_json": text,
    }
    if backend == "sqlite":
        row["seq"] = next_sqlite_seq()
    lock_for_insert(conn, backend)  # tombstones are written under it: checked, then inserted
    if is_deleted(conn, profile_id):
        raise ProfileDeletedError(
            f"profile store {display}: profile {profile_id} was deleted, so it is not stored "
            "again; publish a new profile (probe again) instead",
            profile_id=profile_id,
        )
    statement = insert(backend, profiles).values(**row)
    # RETURNING names the row this statement inserted (none when the id was there already):
    # a rowcount the PostgreSQL driver may leave unset does not decide it.
    statement = statement.on_conflict_do_nothing(index_elements=["id"]).returning(profiles.c.id)
    if conn.execute(statement).first() is not None:
        return profile_id, True
    stored = conn.execute(
        sa.select(profiles.c.profile_json).where(profiles.c.id == profile_id)
    ).scalar_one_or_none()
    if stored is not None and stored != text:
        raise StoreError(
            f"profile store {display}: id {profile_id} already holds another profile (a hash "
            "collision); delete that profile and store again"
        )
    return profile_id, False


def is_deleted(conn: sa.Connection, profile_id: str) -> bool:
    """Whether the store holds a tombstone of ``profile_id`` (``autobatch.store._deletions``)."""
    found = conn.execute(
        sa.select(deletions.c.seq).where(deletions.c.profile_id == profile_id).limit(1)
    ).first()
    return found is not None


def find_resent(conn: sa.Connection, backend: str, profile: Profile) -> tuple[str, Profile] | None:
    """The stored profile that ``profile`` (sent without ``created_at``) repeats: its id and the
    profile as stored, or None. Takes the profiles' insert lock first, so that the caller's
    insert that follows is decided under the same lock."""
    lock_for_insert(conn, backend)
    wanted = canonical(profile)
    rows = conn.execute(
        sa.select(profiles.c.id, profiles.c.profile_json).where(
            profiles.c.cache_key == profile.cache_key(),
            profiles.c.node_name == profile.node_name,
            profiles.c.max_micro_batch_size == profile.max_micro_batch_size,
        )
    ).all()
    for profile_id, text in rows:
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict) and _dumps({**data, "created_at": ""}) == wanted:
            return str(profile_id), Profile.from_dict(data)
    return None
