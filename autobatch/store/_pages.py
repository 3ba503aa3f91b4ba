"""What listings of the store return: summaries of profiles, and pages with the way to the next.

Example::

    page = store.list_summaries(limit=50)
    while page.next_before is not None:
        page = store.list_summaries(limit=50, before=page.next_before)
"""

from __future__ import annotations

import dataclasses

from autobatch.profile import Profile

__all__ = ["ProfilePage", "ProfileSummary", "SummaryPage"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSummary:
    """What a listing shows of a stored profile, read from indexed columns (no JSON decoded)."""

    id: str
    """The profile's id (16 hex digits)."""
    cache_key: str
    model_fingerprint: str
    device_name: str
    """The card type it was measured on (e.g. ``"NVIDIA H100 80GB HBM3"``)."""
    node_name: str
    """The machine it was measured on; ``""`` when not recorded."""
    model_name: str
    """How the profile names its model (``gpt2``, ``GPT2LMHeadModel``); ``""`` when it names
    none (a profile from before profile schema 4)."""
    max_micro_batch_size: int
    recommended_micro_batch_size: int
    created_at: str
    """ISO 8601 time of the measurement, or of storing when the profile carried none."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SummaryPage:
    """One page of :meth:`ProfileStore.list_summaries`, newest first."""

    summaries: tuple[ProfileSummary, ...]
    next_before: str | None
    """Pass as ``before=`` for the next page; None when this page is the last."""
    num_skipped: int = 0
    """Rows on this page left out because they could not be read (logged)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfilePage:
    """One page of :meth:`ProfileStore.page_profiles`: newest first, or oldest first after a
    cursor."""

    profiles: tuple[tuple[str, Profile], ...]
    """``(profile_id, profile)`` pairs."""
    next_before: str | None
    """Pass as ``before=`` for the next page; None when this page is the last."""
    num_skipped: int = 0
    """Rows on this page left out because they could not be read (logged)."""
    next_after: int | None = None
    """When the page was asked ``after`` a cursor: the cursor to ask with next (the same one
    when no profile came since); None otherwise."""
