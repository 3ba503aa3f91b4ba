"""Where autotune's profiles come from and go to: the profile store, the service, the cache rule.

:func:`autobatch.tuning.autotune_profile` looks a profile up before it probes and keeps the one it
probed: :func:`opened_store` (which store, if any), :func:`answers_request` (whether a stored
profile answers this request), :func:`agreed_profile` (the same under torch.distributed: rank 0
reads and writes, every rank uses rank 0's answer) and :func:`report_profile_to` (registering a
new profile with the service, warning rather than failing).

Example::

    with opened_store(None, use_store=True) as store:     # the default store, closed after
        found = store.find(key) if store is not None else None
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable

from autobatch.distributed.consensus import ProcessGroupConsensus
from autobatch.errors import AutobatchError, ReportWarning
from autobatch.profile import Profile
from autobatch.profiles.store import ProfileStore

__all__ = [
    "CAPACITY_TOLERANCE",
    "TunedProfile",
    "agreed_profile",
    "answers_request",
    "opened_store",
    "report_profile_to",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TunedProfile:
    """What :func:`autobatch.tuning.autotune_profile` found."""

    profile: Profile
    cached: bool
    """True when the profile came from the store (no step ran)."""
    profile_id: str | None
    """The profile's id in the store; None when no store was used, on ranks other than 0, or
    when the profile was not stored (a non-OOM failure cut the search short)."""


def opened_store(
    store: ProfileStore | str | os.PathLike[str] | None, *, use_store: bool
) -> contextlib.AbstractContextManager[ProfileStore | None]:
    """The store to use: none without ``use_store``; a given ProfileStore as it is (left open);
    a path (None: the default store) opened here and closed on exit."""
    if not use_store:
        return contextlib.nullcontext()
    if isinstance(store, ProfileStore):
        return contextlib.nullcontext(store)
    return ProfileStore(store)


def agreed_profile(
    consensus: ProcessGroupConsensus,
    key: str,
    *,
    store: ProfileStore | str | os.PathLike[str] | None,
    use_store: bool,
    refresh: bool,
    accepts: Callable[[Profile], bool],
    run_probe: Callable[[], Profile],
    report_to: str | None,
) -> TunedProfile:
    """Under torch.distributed: rank 0 reads the store and every rank uses what it found, or all
    probe together; rank 0 writes the result and every rank returns rank 0's profile.

    The store is used only when every rank has rank 0's cache key (the same device model and
    total memory): a profile of one kind of card does not answer for another.
    """
    use_store = consensus.all_equal(key) and use_store
    opened: list[ProfileStore] = []  # rank 0 only
    profile_id: list[str] = []  # rank 0 only

    def look_up() -> Profile | None:
        if not use_store:
            return None
        if isinstance(store, ProfileStore):
            opened.append(store)
        else:
            opened.append(ProfileStore(store))
        found = None if refresh else opened[0].find(key)
        if found is None or not accepts(found[1]):
            return None
        profile_id.append(found[0])
        return found[1]

    def save(profile: Profile) -> Profile:
        if opened and profile.stop_kind != "failure":
            profile_id.append(opened[0].put(profile))
        report_profile_to(report_to, profile)
        return profile

    try:
        cached = consensus.on_rank_zero(look_up, "reading the profile store")
        if cached is not None:
            return TunedProfile(
                profile=cached, cached=True, profile_id=profile_id[0] if profile_id else None
            )
        profile = run_probe()
        agreed = consensus.on_rank_zero(lambda: save(profile), "writing the profile store")
        return TunedProfile(
            profile=agreed, cached=False, profile_id=profile_id[0] if profile_id else None
        )
    finally:
        if opened and not isinstance(store, ProfileStore):
            opened[0].close()


def report_profile_to(report_to: str | None, profile: Profile) -> None:
    """Register a newly probed profile with the service at ``report_to`` (if any).

    A failure warns (:class:`ReportWarning`) rather than raises: the probe's result is in hand
    and in the local store, and a training script should not die because a scheduler's service
    is down or refused the token.
    """
    if report_to is None:
        return
    from autobatch.client.http import report_profile

    try:
        report_profile(report_to, profile, token=os.environ.get("AUTOBATCH_API_TOKEN"))
    except AutobatchError as exc:
        warnings.warn(
            f"could not register the profile with the autobatch service at {report_to}: {exc}. "
            "The plan is returned and the profile is in the local store; send it later with "
            "autobatch.client.report_profile(url, profile), or probe again with refresh=True",
            ReportWarning,
            stacklevel=_outside_autobatch(),
        )


def _outside_autobatch() -> int:
    """The ``stacklevel`` that points a warning at the user's line: the first caller outside
    the autobatch package (autotune, tune and autotune_profile sit at different depths)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)  # the function that warns
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
        level += 1
    return level


CAPACITY_TOLERANCE = 0.01
"""A stored profile answers while the device's capacity is within this fraction of the capacity
it was probed with: less means another process took memory since (the answer may not fit), more
means the answer would be needlessly small."""


def answers_request(
    profile: Profile, safety_margin: float, max_micro_batch_size: int, capacity_bytes: int
) -> bool:
    """A stored profile answers only a request with the same margin, a limit it respected, and
    (about) the capacity it was probed with; never one a non-OOM failure cut short. A search
    that stopped at its limit answers only for that same limit (a larger one might go further)."""
    return (
        profile.stop_kind != "failure"
        and profile.safety_margin == safety_margin
        and abs(capacity_bytes - profile.capacity_bytes)
        <= profile.capacity_bytes * CAPACITY_TOLERANCE
        and profile.max_micro_batch_size <= max_micro_batch_size
        and (profile.stop_kind != "limit" or profile.max_micro_batch_size == max_micro_batch_size)
    )
