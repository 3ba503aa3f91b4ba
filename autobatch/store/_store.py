"""The profile store: SQLite, the embedded default, or PostgreSQL for a fleet (SQLAlchemy Core).

All of the store's SQL lives in this module, :mod:`autobatch.store._connection` (opening the
database, transactions, the write check, and the one place its errors are translated) and
:mod:`autobatch.store._schema` (tables and migrations); SQLAlchemy is imported when a store
is opened, not when this module is, so ``from autobatch import ProfileStore`` stays light.
Imports neither torch nor pynvml.

One location names the store (:mod:`autobatch.store._location`): a file path, ``":memory:"``,
``sqlite:///...`` or ``postgresql://...``; None means ``$AUTOBATCH_STORE``, the one variable the
library, the CLI and the service all read. A SQLite file may be shared by several processes (WAL
journal, a busy timeout, short ``BEGIN IMMEDIATE`` write transactions); a PostgreSQL database by
any number of processes and machines. One :class:`ProfileStore` may be shared by threads.

A profile's id is a content hash: 16 hex digits of the SHA-256 of its canonical JSON. Storing
the same profile again is a no-op that returns the same id (``INSERT ... ON CONFLICT DO
NOTHING``), so a publisher's retries never duplicate a profile, and concurrent writers on either
backend lose nothing (each insert is one row of its own; nothing is read-modified-written).

The database is never overwritten or migrated silently: a foreign database, one written by a
newer autobatch, or a damaged one raises :class:`~autobatch.errors.StoreError` naming the store
and the fix, and is left as it was; an older store is migrated in place on open.

Example::

    from autobatch.store._store import ProfileStore

    with ProfileStore("postgresql://autobatch@db:5432/profiles") as store:
        profile_id = store.put(profile)          # the same id however often it is retried
        found = store.find(profile.cache_key())
        page = store.list_summaries(device_name="NVIDIA H100 80GB HBM3", limit=50)
        more = store.list_summaries(device_name="NVIDIA H100 80GB HBM3", before=page.next_before)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from autobatch.errors import ConfigError, ProfileNotFoundError, StoreError
from autobatch.profile import PROFILE_SCHEMA_VERSION, Profile
from autobatch.store import _probe_runs as probe_runs
from autobatch.store._connection import StoreConnection
from autobatch.store._copying import copy_rows
from autobatch.store._decoded import DecodedProfiles
from autobatch.store._deletions import DeletionPage, delete_ids, page_deletions
from autobatch.store._fallback import default_or_fallback
from autobatch.store._location import (
    STORE_ENV_VAR,
    Create,
    StoreLocation,
    default_store_path,
    parse_location,
)
from autobatch.store._outbox import Outbox
from autobatch.store._pages import ProfilePage, ProfileSummary, SummaryPage

# _engine, _schema, _sequence and _latest import SQLAlchemy: imported when called, so that
# ``from autobatch import ProfileStore`` stays SQLAlchemy-free.

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = [
    "STORE_ENV_VAR",
    "STORE_SCHEMA_VERSION",
    "ProfilePage",
    "ProfileStore",
    "ProfileSummary",
    "SummaryPage",
    "default_store_path",
    "profile_id_of",
]

STORE_SCHEMA_VERSION = 5
"""Version of the table layout (``autobatch.store._schema.STORE_SCHEMA_VERSION``, repeated
here so that reading it imports no SQLAlchemy; a test keeps the two equal)."""

_DEFAULT_TIMEOUT_SECONDS = 30.0
_log = logging.getLogger("autobatch.store")


def profile_id_of(profile: Profile) -> str:
    """The id :meth:`ProfileStore.put` gives ``profile``: 16 hex digits of the SHA-256 of its
    canonical JSON (the same profile always gets the same id, on any machine)."""
    return hashlib.sha256(_canonical(profile).encode()).hexdigest()[:16]


class ProfileStore:
    """Profiles kept in SQLite or PostgreSQL, newest first.

    "Newest" means most recently stored with :meth:`put`. On SQLite, calls from the threads of
    one process are serialised by a lock (one connection); on PostgreSQL each call takes a
    connection from a small pool.

    Args:
        location: a SQLite file, ``":memory:"`` (tests), ``sqlite:///FILE`` or
            ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DB``; None means ``$AUTOBATCH_STORE``,
            else ``~/.cache/autobatch/profiles.sqlite3``, or, when this user may not write
            that, ``$TMPDIR/autobatch-<uid>/`` or memory, with one warning
            (:mod:`autobatch.store._fallback`).
        timeout_seconds: how long a call waits for another writer's lock (or a PostgreSQL
            connection) before giving up, in seconds.
        create: what opening a SQLite file may create, so that a mistyped location is an error
            rather than a new empty store: ``"folders"`` (the default) the file and its missing
            parent directories, ``"file"`` the file in an existing directory only, ``"never"``
            nothing (for reading: the file must exist). A PostgreSQL database must exist in
            every case (its tables are created in it).
        open_later: when the database cannot be reached now (no server, no such database),
            return anyway and open it on first use: each call raises StoreError until it
            answers (a service replica that starts before its database).

    Raises:
        ConfigError: the location is a URL of another scheme (``mysql://``...), or ``create``
            is none of the three.
        StoreError: the store cannot be opened or created (permissions, a directory in the way,
            no server), does not exist where ``create`` forbids creating it, is not an autobatch
            store, was written by a newer autobatch, or is damaged. It is left untouched in
            every case.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | None = None,
        *,
        timeout_seconds: float = _DEFAULT_TIMEOUT_SECONDS,
        create: Create = "folders",
        open_later: bool = False,
    ) -> None:
        if location is None:  # the default falls back when it cannot be written; nothing else
            location = default_or_fallback()
        self._location: StoreLocation = parse_location(location)
        self.path: pathlib.Path | None = self._location.path
        """The SQLite file (``Path(":memory:")`` in memory); None on PostgreSQL."""
        self.location = self._location.display
        """Where the store is, as it may be shown: the file, or the URL without its password."""
        self.backend = self._location.backend
        """``"sqlite"`` or ``"postgresql"``."""
        self.num_unreadable_rows = 0
        """Rows skipped by listings since the store was opened, as they did not decode."""
        self._db = StoreConnection(
            self._location, timeout_seconds=timeout_seconds, create=create, open_later=open_later
        )
        self._decoded = DecodedProfiles()
        self.outbox = Outbox(self._db, self.backend)
        """Profiles waiting for the central service (``service.fleet.publisher``)."""

    def __repr__(self) -> str:
        return f"ProfileStore({self.location!r})"

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def shared_location(self) -> str | None:
        """The location another process opens to reach this store (a PostgreSQL URL includes
        its password: hand it to a child process, never to a log); None in memory."""
        if self._location.in_memory:
            return None
        return str(self.path) if self.path is not None else self._location.url

    def close(self) -> None:
        """Close the store's connections. Idempotent; any later call raises StoreError."""
        self._db.close()

    def put(self, profile: Profile) -> str:
        """Store ``profile``; storing it again changes nothing and returns the same id.

        Args:
            profile: the profile to keep. Its ``created_at`` is indexed as given, or as the time
                of storing when empty.

        Returns:
            Its id, 16 hexadecimal characters (:func:`profile_id_of`).

        Raises:
            ProfileDeletedError: the store deleted this profile (never stored again).
            StoreError: the store is closed, locked longer than the timeout, or not writable.
        """
        from autobatch.store._publishing import insert_profile

        with self._db.write("store a profile") as conn:
            return insert_profile(conn, self.backend, profile, display=self.location)[0]

    def publish(self, profile: Profile) -> tuple[str, Profile, bool]:
        """Store a profile sent by another process, once however often it is resent.

        A profile without ``created_at`` is stamped with the time it is first stored; sent
        again (a publisher's retry after an answer it never read), it finds the stored one
        instead of a second row (``autobatch.store._publishing``). One with ``created_at`` is
        stored once by its id, as :meth:`put` does.

        Returns:
            Its id, the profile as stored (with its ``created_at``), and whether this call
            stored it (False: it was stored already).

        Raises:
            ProfileDeletedError, StoreError: as :meth:`put`.
        """
        from autobatch.store._publishing import find_resent, insert_profile

        with self._db.write("store a profile") as conn:
            if not profile.created_at:
                found = find_resent(conn, self.backend, profile)
                if found:
                    return found[0], found[1], False
                now = datetime.datetime.now(datetime.UTC).isoformat()
                profile = dataclasses.replace(profile, created_at=now)
            profile_id, stored = insert_profile(conn, self.backend, profile, display=self.location)
        return profile_id, profile, stored

    def get(self, profile_id: str) -> Profile:
        """The profile stored under ``profile_id``.

        Raises:
            ProfileNotFoundError: no profile has that id (also a ``KeyError``).
            StoreError: the stored profile was written by a newer autobatch or is not a valid
                profile, or the store is closed or unreadable.
        """
        from autobatch.store._schema import profiles

        query = sa_select(profiles.c.id, profiles.c.profile_json).where(profiles.c.id == profile_id)
        with self._db.read("read a profile") as conn:
            row = conn.execute(query).first()
        if row is None:
            raise ProfileNotFoundError(
                f"no profile with id {profile_id!r} in {self.location}", profile_id=profile_id
            )
        return self._decode(row[0], row[1])

    def find(self, cache_key: str) -> tuple[str, Profile] | None:
        """The newest readable profile stored under ``cache_key`` (see
        :meth:`Profile.cache_key`).

        Profiles written by a newer autobatch (a ``schema_version`` this one cannot read), and
        rows that do not decode (logged), are skipped.

        Returns:
            ``(profile_id, profile)``, or ``None`` when none matches.

        Raises:
            StoreError: the store is closed or unreadable.
        """
        from autobatch.store._schema import profiles

        query = (
            sa_select(profiles.c.id, profiles.c.profile_json)
            .where(profiles.c.cache_key == cache_key)
            .where(profiles.c.profile_schema_version <= PROFILE_SCHEMA_VERSION)
            .order_by(profiles.c.seq.desc())
            .limit(20)
        )
        with self._db.read("find a profile") as conn:
            rows = conn.execute(query).all()
        found = self._decode_all(rows)
        return found[0] if found else None

    def list_profiles(
        self,
        *,
        model_fingerprint: str | None = None,
        device_name: str | None = None,
        node_name: str | None = None,
        limit: int = 100,
        before: str | None = None,
    ) -> list[tuple[str, Profile]]:
        """Stored profiles, newest first, whole. Prefer :meth:`list_summaries` for listings.

        Profiles written by a newer autobatch are skipped, and so are rows that do not decode
        (logged and counted in :attr:`num_unreadable_rows`): one bad row never fails a listing.

        Args:
            model_fingerprint: only profiles of this model, when given.
            device_name: only profiles measured on this card type (e.g. ``"NVIDIA H200"``).
            node_name: only profiles measured on this machine.
            limit: at most this many rows are read, >= 1.
            before: only profiles stored before the one with this id (the last id of the
                previous page).

        Returns:
            ``(profile_id, profile)`` pairs, newest first.

        Raises:
            ConfigError: ``limit`` is below 1.
            ProfileNotFoundError: ``before`` names no stored profile.
            StoreError: the store is closed or unreadable.
        """
        return list(
            self.page_profiles(
                model_fingerprint=model_fingerprint,
                device_name=device_name,
                node_name=node_name,
                limit=limit,
                before=before,
            ).profiles
        )

    def page_profiles(
        self,
        *,
        model_fingerprint: str | None = None,
        device_name: str | None = None,
        node_name: str | None = None,
        limit: int = 100,
        before: str | None = None,
        max_bytes: int | None = None,
        after: int | None = None,
    ) -> ProfilePage:
        """One page of whole profiles, of bounded size: newest first, or with ``after`` the
        ones stored after that cursor, oldest first.

        Rows are read a few at a time (a server-side cursor on PostgreSQL), so a page never
        holds more than its profiles.

        Following the store: pass ``after=0``, then each page's ``next_after``. The cursor is
        ``seq``, which follows commit order on both backends (SQLite serialises writers; on
        PostgreSQL a writer draws ``seq`` under a transaction-scoped advisory lock held to its
        commit), so a row that commits later never has a smaller cursor, and a follower misses
        none however writers' transactions interleave.

        Args:
            max_bytes: end the page once the profiles read hold more than this many bytes of
                JSON (it always holds one); None for no bound.
            after: a cursor (``0``: from the first profile): the page holds profiles stored
                after it, oldest first. Not with ``before``.
            others: as :meth:`list_profiles`.

        Returns:
            The page, with the ``before`` that gives the next one (newest first), or the
            ``next_after`` to follow with (oldest first).

        Raises:
            ConfigError: ``after`` is negative or given with ``before``; as :meth:`list_profiles`.
            As :meth:`list_profiles`.
        """
        from autobatch.store._schema import profiles

        if after is not None and (after < 0 or before is not None):
            raise ConfigError(
                f"after {after!r} must be a cursor >= 0 (0: from the first profile), and is "
                "not given with before (after follows oldest first, before pages newest first)"
            )
        query = self._listing(
            sa_select(profiles.c.seq, profiles.c.id, profiles.c.profile_json),
            model_fingerprint=model_fingerprint,
            device_name=device_name,
            node_name=node_name,
            limit=limit,
            after=after,
        )
        rows: list[tuple[int, str, str]] = []
        num_bytes = 0
        with self._db.read("list profiles") as conn:
            paged = self._paged(conn, query, before)
            streamed = conn.execution_options(stream_results=True, yield_per=16).execute(paged)
            for seq, profile_id, text in streamed:
                rows.append((seq, profile_id, text))
                num_bytes += len(text)
                if max_bytes is not None and num_bytes > max_bytes:
                    break
            streamed.close()
        full = len(rows) == limit or (max_bytes is not None and num_bytes > max_bytes)
        found = self._decode_all([(profile_id, text) for _seq, profile_id, text in rows])
        return ProfilePage(
            profiles=tuple(found),
            next_before=rows[-1][1] if full and rows and after is None else None,
            num_skipped=len(rows) - len(found),
            next_after=None if after is None else (rows[-1][0] if rows else after),
        )

    def list_summaries(
        self,
        *,
        model_fingerprint: str | None = None,
        device_name: str | None = None,
        node_name: str | None = None,
        limit: int = 100,
        before: str | None = None,
    ) -> SummaryPage:
        """One page of summaries of the stored profiles, newest first; no profile is decoded.

        Args: as :meth:`list_profiles`.

        Returns:
            The page, and the ``before`` that gives the next one.

        Raises:
            ConfigError: ``limit`` is below 1.
            ProfileNotFoundError: ``before`` names no stored profile.
            StoreError: the store is closed or unreadable.
        """
        from autobatch.store._schema import profiles

        columns = [profiles.c[name] for name in ProfileSummary.__dataclass_fields__ if name != "id"]
        query = self._listing(
            sa_select(profiles.c.id, *columns),
            model_fingerprint=model_fingerprint,
            device_name=device_name,
            node_name=node_name,
            limit=limit,
        )
        with self._db.read("list profiles") as conn:
            rows = conn.execute(self._paged(conn, query, before)).all()
        summaries = []
        for row in rows:
            values = row._asdict()
            if values["max_micro_batch_size"] is None:  # a migrated row that did not decode
                continue
            summaries.append(ProfileSummary(**values | {"model_name": values["model_name"] or ""}))
        skipped = len(rows) - len(summaries)
        if skipped:
            self._skipped(skipped, "they have no micro-batch sizes (not decodable when migrated)")
        return SummaryPage(
            summaries=tuple(summaries),
            next_before=rows[-1].id if len(rows) == limit else None,
            num_skipped=skipped,
        )

    def latest_per_node(
        self, *, model_fingerprint: str, limit: int, card: Callable[[str], bool] | None = None
    ) -> list[tuple[str, Profile]]:
        """Each node's newest profile of the model per cache key (card, step, conditions),
        newest first, at most ``limit`` (:mod:`autobatch.store._latest`); with ``card``, only
        those whose ``device_name`` it accepts (no other is decoded). Unreadable rows are
        skipped. Raises StoreError: the store is closed or unreadable."""
        from autobatch.store._latest import latest_rows

        rows = latest_rows(self._db, model_fingerprint=model_fingerprint, limit=limit)
        return self._decode_all((i, text) for i, name, text in rows if card is None or card(name))

    def copy_into(
        self,
        target: ProfileStore,
        *,
        batch_size: int = 500,
        on_uncopied: Callable[[str, str], None] | None = None,
    ) -> int:
        """Copy every profile of this store into ``target``, oldest first, ids kept.

        How a SQLite store moves to the fleet's PostgreSQL: rows are copied as stored (a
        version-1 row keeps its old id), in batches, each batch one write transaction on
        ``target``. Profiles ``target`` already holds are left as they are, so a copy that was
        interrupted can simply be run again. A row holding text some backend cannot store (a
        NUL, which SQLite keeps and PostgreSQL refuses: ``autobatch.store._storable``) is
        left out, logged and reported, and the others are copied.

        Args:
            target: the store to copy into (another backend or file).
            batch_size: rows per read and per write transaction, >= 1.
            on_uncopied: called with ``(profile_id, why)`` for each row left out.

        Returns:
            The number of profiles that were new to ``target``.

        Raises:
            ConfigError: ``batch_size`` is below 1.
            StoreError: either store is closed, unreadable or not writable.
        """
        return copy_rows(
            self._db, target._db, target, batch_size=batch_size, on_uncopied=on_uncopied
        )

    def delete(self, profile_id: str) -> bool:
        """Remove ``profile_id`` as :meth:`forget` does; True when it was stored. Raises
        StoreError: as :meth:`forget`."""
        return bool(self.forget([profile_id]))

    def forget(self, profile_ids: Iterable[str], *, absent_too: bool = False) -> list[str]:
        """Remove the ``profile_ids`` held, in one transaction, each leaving a tombstone (never
        stored again: ProfileDeletedError); the ids removed. ``absent_too``: tombstone those not
        held too (a node following central). Raises StoreError: closed, locked, not writable."""
        return delete_ids(self._db, self.backend, profile_ids, absent_too=absent_too)

    def page_deletions(self, *, after: int = 0, limit: int = 100) -> DeletionPage:
        """Tombstones of deleted profiles after cursor ``after`` (0: the first), oldest first,
        at most ``limit``; follow with each page's ``next_after``.

        Raises:
            ConfigError: ``after`` < 0 or ``limit`` < 1. StoreError: the store is unreadable."""
        return page_deletions(self._db, after=after, limit=limit)

    def put_probe_run(self, run_id: str, record: Mapping[str, Any]) -> None:
        """Keep (or replace) the record of the service's probe run ``run_id`` (``record`` is
        JSON-ready).

        Raises:
            StoreError: the store is closed, locked longer than the timeout, or not writable.
        """
        probe_runs.put_probe_run(self._db, self.backend, run_id, record)

    def get_probe_run(self, run_id: str) -> dict[str, Any] | None:
        """The record kept by :meth:`put_probe_run` for ``run_id``; None when there is none.

        Raises:
            StoreError: the store is closed or unreadable, or the record does not decode.
        """
        return probe_runs.get_probe_run(self._db, run_id)

    def check_writable(self) -> None:
        """Check that a write would succeed now (for a readiness probe); writes nothing.

        Takes the write lock and makes a change that is rolled back. A SQLite file that was
        deleted or replaced since the store opened it fails the check: writes would go to a
        file no other process (nor a restart) sees.

        Raises:
            StoreError: the store is closed, read-only, locked by another writer for longer
                than the timeout, unreachable, its file was deleted or replaced, or the disk
                holding it has under ``MIN_FREE_BYTES`` (1 MiB) free.
        """
        self._db.check_writable()

    def _listing(
        self,
        query: sa.Select[Any],
        *,
        model_fingerprint: str | None,
        device_name: str | None,
        node_name: str | None,
        limit: int,
        after: int | None = None,
    ) -> sa.Select[Any]:
        from autobatch.store._schema import profiles

        if limit < 1:
            raise ConfigError(f"limit {limit} must be >= 1")
        query = query.where(profiles.c.profile_schema_version <= PROFILE_SCHEMA_VERSION)
        for column, value in (
            (profiles.c.model_fingerprint, model_fingerprint),
            (profiles.c.device_name, device_name),
            (profiles.c.node_name, node_name),
        ):
            if value is not None:
                query = query.where(column == value)
        if after is not None:
            return query.where(profiles.c.seq > after).order_by(profiles.c.seq).limit(limit)
        return query.order_by(profiles.c.seq.desc()).limit(limit)

    def _paged(
        self, conn: sa.Connection, query: sa.Select[Any], before: str | None
    ) -> sa.Select[Any]:
        from autobatch.store._schema import profiles

        if before is None:
            return query
        seq = conn.execute(
            sa_select(profiles.c.seq).where(profiles.c.id == before)
        ).scalar_one_or_none()
        if seq is None:
            raise ProfileNotFoundError(
                f"no profile with id {before!r} in {self.location} to list the profiles before; "
                "start again from the first page",
                profile_id=before,
            )
        return query.where(profiles.c.seq < seq)

    def _decode(self, profile_id: str, text: str) -> Profile:
        try:
            return self._decoded.get(profile_id, text)
        except (ConfigError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise StoreError(
                f"cannot read profile {profile_id!r} from {self.location}: {exc}; upgrade "
                "autobatch, or delete the profile"
            ) from exc

    def _decode_all(self, rows: Any) -> list[tuple[str, Profile]]:
        found = []
        for profile_id, text in rows:
            try:
                found.append((profile_id, self._decode(profile_id, text)))
            except StoreError as exc:
                _log.warning("%s (skipped)", exc)
                self._skipped(1, None)
        return found

    def _skipped(self, count: int, why: str | None) -> None:
        self.num_unreadable_rows += count
        if why is not None:
            _log.warning("profile store %s: %d rows skipped: %s", self.location, count, why)


def sa_select(*columns: Any) -> sa.Select[Any]:
    """``sqlalchemy.select``, imported on first use."""
    import sqlalchemy as sa

    return sa.select(*columns)


def _canonical(profile: Profile) -> str:
    from autobatch.store._publishing import canonical

    return canonical(profile)
