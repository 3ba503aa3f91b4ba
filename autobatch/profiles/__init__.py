"""Profiles: the store (``store``), the cache rule and reporting (``cache``), confirmation on
arrival of a plan predicted from another card (``confirmation``), and the protocol of a remote
beyond the store (``remote``; the road passes one down, e.g. the central service). This face
(torch-free) is the store and that protocol, what the service and the CLI import. The store's
location is a file, ``:memory:`` or a ``sqlite://``/``postgresql://`` URL (``location``); its
tables and migrations are in ``schema``; the text every backend can hold, in ``storable``.

Example::

    from autobatch.profiles import ProfileStore

    with ProfileStore() as store:          # $AUTOBATCH_STORE, or the default file
        store.list_profiles()
"""

from __future__ import annotations

from autobatch.profiles.location import parse_location
from autobatch.profiles.remote import ProfileRemote
from autobatch.profiles.storable import unstorable, unstorable_in
from autobatch.profiles.store import (
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
    "ProfilePage",
    "ProfileRemote",
    "ProfileStore",
    "ProfileSummary",
    "SummaryPage",
    "default_store_path",
    "parse_location",
    "profile_id_of",
    "unstorable",
    "unstorable_in",
]
