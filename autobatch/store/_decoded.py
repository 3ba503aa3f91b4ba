"""The profiles a store decoded lately, by their stored text: a plan by card reads the same few
dozen profiles on every request, and decoding one (JSON, then :meth:`Profile.from_dict`) costs
more than reading it.

A stored row never changes (an id is its profile's content hash, and rows are only inserted or
deleted), and a :class:`~autobatch.profile.Profile` is frozen, so a decoded profile is handed
out again as long as its row's text is the same; the text is compared on every hit.

Example::

    decoded = DecodedProfiles()
    profile = decoded.get("3fa9...", text)     # decoded once, then from memory
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from autobatch.profile import Profile

__all__ = ["DECODED_BYTES", "DecodedProfiles"]

DECODED_BYTES = 16 << 20
"""Stored text of the profiles kept decoded per store, the least recently read dropped first:
16 MiB (a fleet's plans by card read a few profiles of a few KiB per node and model). A profile
whose text alone is over a sixteenth of it (1 MiB: thousands of trials) is decoded each time,
never kept."""


class DecodedProfiles:
    """A bounded map of stored text to decoded profile, shared by a store's threads."""

    def __init__(self, max_bytes: int = DECODED_BYTES) -> None:
        self._max_bytes = max_bytes
        self._num_bytes = 0
        self._lock = threading.Lock()
        self._found: OrderedDict[str, tuple[str, Profile]] = OrderedDict()

    def get(self, profile_id: str, text: str) -> Profile:
        """The profile stored as ``text`` under ``profile_id``, decoded once while kept.

        Raises:
            ConfigError, ValueError, TypeError, KeyError, AttributeError: ``text`` is not a
                profile this autobatch reads (the store translates them).
        """
        with self._lock:
            found = self._found.get(profile_id)
            if found is not None and found[0] == text:
                self._found.move_to_end(profile_id)
                return found[1]
        profile = Profile.from_dict(json.loads(text))
        if len(text) * 16 <= self._max_bytes:
            self._keep(profile_id, text, profile)
        return profile

    def _keep(self, profile_id: str, text: str, profile: Profile) -> None:
        with self._lock:
            old = self._found.pop(profile_id, None)
            if old is not None:
                self._num_bytes -= len(old[0])
            self._found[profile_id] = (text, profile)
            self._num_bytes += len(text)
            while self._num_bytes > self._max_bytes:
                _, (dropped, _) = self._found.popitem(last=False)
                self._num_bytes -= len(dropped)
