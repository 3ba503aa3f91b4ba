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

__all__ = ["DECODED_PROFILES", "DecodedProfiles"]

DECODED_PROFILES = 1024
"""Decoded profiles kept per store, the least recently read dropped first: a fleet's plans by
card read a few per node and model (about 10 KiB each in memory: 10 MiB at most)."""


class DecodedProfiles:
    """A bounded map of stored text to decoded profile, shared by a store's threads."""

    def __init__(self, size: int = DECODED_PROFILES) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._found: OrderedDict[str, tuple[str, Profile]] = OrderedDict()

    def get(self, profile_id: str, text: str) -> Profile:
        """The profile stored as ``text`` under ``profile_id``, decoded once.

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
        with self._lock:
            self._found[profile_id] = (text, profile)
            if len(self._found) > self._size:
                self._found.popitem(last=False)
        return profile
