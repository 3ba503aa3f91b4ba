"""Profiles: the store (``store``), the cache rule and reporting (``cache``), and confirmation on
arrival of a plan predicted from another card (``confirmation``). This face (torch-free) is the
store, what the service and the CLI import.

Example::

    from autobatch.profiles import ProfileStore

    with ProfileStore() as store:          # $AUTOBATCH_STORE, or the default file
        store.list_profiles()
"""

from __future__ import annotations

from autobatch.profiles.store import STORE_ENV_VAR, ProfileStore, default_store_path

__all__ = ["STORE_ENV_VAR", "ProfileStore", "default_store_path"]
