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

import importlib
from typing import TYPE_CHECKING, Any

from autobatch.profiles._location import Create, parse_location, redact
from autobatch.profiles._outbox import OutboxEntry
from autobatch.profiles._remote import ProfileRemote
from autobatch.profiles._storable import unstorable, unstorable_in
from autobatch.profiles._store import (
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
    "ArrivalPrediction",
    "Create",
    "OutboxEntry",
    "ProfilePage",
    "ProfileRemote",
    "ProfileStore",
    "ProfileSummary",
    "StoreOptions",
    "SummaryPage",
    "Superseded",
    "TunedProfile",
    "agreed_profile",
    "answers_request",
    "confirm_on_arrival",
    "default_store_path",
    "find_prediction",
    "parse_location",
    "profile_id_of",
    "redact",
    "stored_profiles",
    "superseded_in",
    "unstorable",
    "unstorable_in",
    "user_stacklevel",
]

if TYPE_CHECKING:
    from autobatch.profiles._cache import (
        StoreOptions,
        Superseded,
        TunedProfile,
        agreed_profile,
        answers_request,
        superseded_in,
        user_stacklevel,
    )
    from autobatch.profiles._confirmation import (
        ArrivalPrediction,
        confirm_on_arrival,
        find_prediction,
        stored_profiles,
    )

# The road's store lane (the cache rule across ranks, confirmation on arrival) needs torch's
# collectives; it is loaded on first use so that the store, what the service and the CLI
# import, stays torch-free.
_LAZY_EXPORTS = {
    **dict.fromkeys(
        (
            "StoreOptions",
            "Superseded",
            "TunedProfile",
            "agreed_profile",
            "answers_request",
            "superseded_in",
            "user_stacklevel",
        ),
        "autobatch.profiles._cache",
    ),
    **dict.fromkeys(
        ("ArrivalPrediction", "confirm_on_arrival", "find_prediction", "stored_profiles"),
        "autobatch.profiles._confirmation",
    ),
}

if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _LAZY_EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'autobatch.profiles' has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)
