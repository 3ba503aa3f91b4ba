"""Profiles: the store (``store``), the cache rule and reporting (``cache``), and confirmation on
arrival of a plan predicted from another card (``confirmation``). This face (torch-free) is the
store, what the service and the CLI import. The store's location is a file, ``:memory:`` or a
``sqlite://``/``postgresql://`` URL (``location``); its tables and migrations are in ``schema``.

Example::

    from autobatch.profiles import ProfileStore

    with ProfileStore() as store:          # $AUTOBATCH_STORE, or the default file
        store.list_profiles()
"""

from __future__ import annotations

from autobatch.profiles.location import parse_location
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
    "ProfileStore",
    "ProfileSummary",
    "SummaryPage",
    "default_store_path",
    "parse_location",
    "profile_id_of",
]
