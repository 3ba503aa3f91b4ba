"""Profiles, storage only: the store (``store``) and the protocol of a remote beyond it
(``remote``; the road passes one down, e.g. the central service). Imports no torch: the cache
rule across ranks and confirmation on arrival are the tuning road's
(:mod:`autobatch.tuning`). The store's location is a file, ``:memory:`` or a
``sqlite://``/``postgresql://`` URL (``location``); its tables and migrations are in ``schema``;
the text every backend can hold, in ``storable``.

Example::

    from autobatch.store import ProfileStore

    with ProfileStore() as store:          # $AUTOBATCH_STORE, or the default file
        store.list_profiles()
"""

from __future__ import annotations

from autobatch.store._deletions import Deletion, DeletionPage
from autobatch.store._location import Create, parse_location, redact
from autobatch.store._outbox import OutboxEntry
from autobatch.store._remote import ProfileRemote
from autobatch.store._storable import unstorable, unstorable_in
from autobatch.store._store import (
    STORE_ENV_VAR,
    ProfilePage,
    ProfileStore,
    ProfileSummary,
    SummaryPage,
    default_store_path,
    profile_id_of,
)

__all__ = [
    "STORE_ENV_VAR",
    "Create",
    "Deletion",
    "DeletionPage",
    "OutboxEntry",
    "ProfilePage",
    "ProfileRemote",
    "ProfileStore",
    "ProfileSummary",
    "SummaryPage",
    "default_store_path",
    "parse_location",
    "profile_id_of",
    "redact",
    "unstorable",
    "unstorable_in",
]
