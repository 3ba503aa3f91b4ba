"""Where the tuning road's profiles come from and go to: the profile store, a remote (the service),
the cache rule.

The road (:mod:`autobatch.tuning`) looks a profile up before it probes and keeps the one it
probed through one lane, :func:`agreed_profile`, for one process and for the ranks of a process
group alike (rank 0 reads and writes, every rank uses rank 0's answer); :func:`answers_request`
is the rule for whether a stored profile answers a request, and :func:`report_profile_to`
hands a new profile to the remote the road passed down
(:class:`~autobatch.store.ProfileRemote`, e.g. the central service), warning rather
than failing.

Example::

    found = agreed_profile(LocalConsensus(), key, StoreOptions(store=path),
                           accepts=lambda p: True, run_probe=lambda: run_probe(step, options))
    found.profile, found.cached
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Callable

from autobatch.conditions import ConditionChange, Conditions, condition_changes
from autobatch.distributed import LocalConsensus, ProcessGroupConsensus
from autobatch.errors import Remedy, ReportWarning
from autobatch.profile import Mode, Profile, StepIdentity
from autobatch.store import ProfileRemote, ProfileStore
from autobatch.units import format_bytes

__all__ = [
    "CAPACITY_TOLERANCE",
    "EXPLAINED_PROFILES",
    "SAME_SLOPE",
    "Confirm",
    "Ranks",
    "StoreOptions",
    "Superseded",
    "TunedProfile",
    "agreed_profile",
    "answers_request",
    "report_profile_to",
    "superseded_in",
    "user_stacklevel",
]

logger = logging.getLogger("autobatch")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoreOptions:
    """Where profiles come from and go to, for one tuning: built once at the public entry point."""

    store: ProfileStore | str | os.PathLike[str] | None = None
    """A ProfileStore (left open), a path, or None for the default store."""
    use_store: bool = True
    """False: no read, no write."""
    refresh: bool = False
    """Probe again even when the store has a profile that answers."""
    remote: ProfileRemote | None = None
    """Profiles beyond the store (e.g. the central service, built by the road from
    ``report_to``): asked for a profile of this step on another card, and given every newly
    measured profile; None: the store alone."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Superseded:
    """A stored profile of the same step on the same card that did not answer because the
    conditions it was measured under differ from the live process's."""

    profile_id: str
    profile: Profile
    changes: tuple[ConditionChange, ...]
    """What differs (:func:`autobatch.conditions.condition_changes`), at least one."""

    def describe(self) -> str:
        """Why the store did not answer, naming each condition, both values and the fix."""
        return (
            f"stored profile {self.profile_id} of this step on this card was measured under other "
            f"conditions, so it was probed again: "
            + "; ".join(change.describe() for change in self.changes)
        )

    def checkpointing_in_vain(self, probed: Profile) -> str:
        """When activation checkpointing is what changed and ``probed`` (the new profile) needs
        as many bytes per sample as this one (within :data:`SAME_SLOPE`): that it changed
        nothing, with both slopes and what to check; ``""`` otherwise."""
        before, after = self.profile.memory_model, probed.memory_model
        toggled = any(change.name == "activation checkpointing" for change in self.changes)
        if not toggled or before is None or after is None:
            return ""
        slopes = (before.bytes_per_sample, after.bytes_per_sample)
        if abs(slopes[0] - slopes[1]) > SAME_SLOPE * max(slopes):
            return ""
        return (
            f"activation checkpointing changed nothing: {format_bytes(slopes[1])} per sample now "
            f"({probed.conditions.activation_checkpointing}), {format_bytes(slopes[0])} in "
            f"profile {self.profile_id} ({self.profile.conditions.activation_checkpointing}); "
            "check that it wraps the layers whose activations dominate, and that they run it "
            "(Hugging Face models checkpoint only in training mode)"
        )


SAME_SLOPE = 0.05
"""Bytes per sample with and without activation checkpointing within this fraction of each
other: checkpointing changed nothing."""

EXPLAINED_PROFILES = 20
"""Stored profiles of the model on the card that a store miss looks through for the reason."""


def superseded_in(
    store: ProfileStore,
    identity: StepIdentity,
    live: Conditions,
    *,
    device_name: str,
    total_memory_bytes: int,
    compiled: str,
    mode: Mode,
) -> Superseded | None:
    """The newest stored profile of the step ``identity`` on this card (name, total memory,
    compiled, mode), when its conditions differ from ``live``; None otherwise (none stored, or
    the newest agrees on its conditions and something else kept it from answering)."""
    same = (identity, total_memory_bytes, compiled, mode)
    for profile_id, stored in store.list_profiles(
        model_fingerprint=identity.model_fingerprint,
        device_name=device_name,
        limit=EXPLAINED_PROFILES,
    ):
        if (stored.identity, stored.total_memory_bytes, stored.compiled, stored.mode) != same:
            continue
        changes = condition_changes(stored.conditions, live)
        return (
            Superseded(profile_id=profile_id, profile=stored, changes=changes) if changes else None
        )
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TunedProfile:
    """What the tuning road found."""

    profile: Profile
    cached: bool
    """True when the profile came from the store (no step ran)."""
    profile_id: str | None
    """The profile's id in the store; None when no store was used, on ranks other than 0, or
    when the profile was not stored (a non-OOM failure cut the search short)."""
    superseded: Superseded | None = None
    """The stored profile that would have answered but for a change of conditions (it was
    probed again, and the new profile's notes say why); None otherwise."""


Ranks = ProcessGroupConsensus | LocalConsensus
"""The ranks tuning together: a process group, or this process alone."""

Confirm = Callable[[ProfileStore | None], tuple[Profile | None, str]]
"""Confirmation on arrival: given the opened store (None without one), a profile confirmed on
this card, or None and a note saying why not (``""`` when nothing was predicted)."""

Explain = Callable[[ProfileStore], Superseded | None]
"""Why the store had no answer: a stored profile of the same step on this card whose conditions
differ from the live process's, or None."""


def agreed_profile(
    ranks: Ranks,
    key: str,
    storing: StoreOptions,
    *,
    accepts: Callable[[Profile], bool],
    run_probe: Callable[[], Profile],
    confirm: Confirm | None = None,
    explain: Explain | None = None,
) -> TunedProfile:
    """The one store lane, for one process and for every rank of a process group: rank 0 reads
    the store and every rank uses what it found, or all probe together; rank 0 writes the result
    (unless a non-OOM failure cut it short) and reports it (a stored profile that answered is
    reported too: the remote may not have it), and every rank returns rank 0's profile.

    Under a process group the store is used only when every rank has rank 0's cache key (the
    same device model and total memory): a profile of one kind of card does not answer for
    another.

    Args:
        ranks: who tunes together.
        key: the cache key of this request's step, device and mode.
        storing: which store, and whether to read it.
        accepts: whether a stored profile answers this request (:func:`answers_request`).
        run_probe: probes (every rank calls it together).
        confirm: one process only: before probing, a plan predicted from another card's profile
            is confirmed by one real trial (:mod:`autobatch.tuning._confirmation`).
        explain: when the store has no answer, a stored profile of the same step on this card
            that a change of conditions kept from answering: the probe's profile notes it and
            the ``autobatch`` logger warns with it (never with ``refresh``).
    """
    use_store = ranks.all_equal(key) and storing.use_store
    opened: list[ProfileStore] = []  # rank 0 only
    profile_id: list[str] = []  # rank 0 only

    def look_up() -> tuple[Profile | None, Superseded | None]:
        if not use_store:
            return None, None
        given = storing.store
        opened.append(given if isinstance(given, ProfileStore) else ProfileStore(given))
        if storing.refresh:
            return None, None
        found = opened[0].find(key)
        if found is not None and accepts(found[1]):
            profile_id.append(found[0])
            return found[1], None
        return None, explain(opened[0]) if explain is not None else None

    def save(profile: Profile) -> Profile:
        if opened and profile.stop_kind != "failure":
            profile_id.append(opened[0].put(profile))
        report_profile_to(storing.remote, profile, stored=bool(profile_id))
        return profile

    try:
        cached, superseded = ranks.on_rank_zero(look_up, "reading the profile store")
        if cached is not None:
            # The remote may not have it (a store filled before report_to was given, another
            # service); publishing is idempotent: one it holds is answered, not stored twice.
            stored = cached
            ranks.on_rank_zero(
                lambda: report_profile_to(storing.remote, stored, stored=True),
                "reporting the stored profile",
            )
            return TunedProfile(
                profile=cached, cached=True, profile_id=profile_id[0] if profile_id else None
            )
        if superseded is not None:
            logger.warning("%s", superseded.describe())
        note = ""
        if confirm is not None and not storing.refresh:
            confirmed, note = confirm(opened[0] if opened else None)
            if confirmed is not None:
                save(confirmed)
                return TunedProfile(
                    profile=confirmed,
                    cached=False,
                    profile_id=profile_id[0] if profile_id else None,
                    superseded=superseded,
                )
            if note:
                logger.warning("%s", note)
        profile = run_probe()
        said = [note] if note else []
        if superseded is not None:
            said.append(superseded.describe())
        if said:
            profile = dataclasses.replace(profile, notes=(*profile.notes, *said))
        agreed = ranks.on_rank_zero(lambda: save(profile), "writing the profile store")
        return TunedProfile(
            profile=agreed,
            cached=False,
            profile_id=profile_id[0] if profile_id else None,
            superseded=superseded,
        )
    finally:
        if opened and not isinstance(storing.store, ProfileStore):
            opened[0].close()


def report_profile_to(remote: ProfileRemote | None, profile: Profile, *, stored: bool) -> None:
    """Hand a newly probed profile, or a stored one that answered, to ``remote`` (if any).

    A failure warns (:class:`ReportWarning`, the remote's words, and where the profile is:
    ``stored`` says whether the local store took it) rather than raises: the probe's result is
    in hand, and a training script should not die because a scheduler's service is down or
    refused the token.
    """
    if remote is None:
        return
    failure = remote.report(profile)
    if failure:
        kept = "the profile is in the local store" if stored else "no store kept the profile"
        failure = f"{failure}. The plan is returned and {kept}"
        again = Remedy(parameter="refresh", values=(True,), purpose="probe again and send it")
        warnings.warn(ReportWarning(failure, remedies=(again,)), stacklevel=user_stacklevel())


def user_stacklevel() -> int:
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
    profile: Profile, safety_margin: float, search_limit: int, capacity_bytes: int
) -> bool:
    """A stored profile answers only a request with the same margin, a search cap its measured
    maximum respects, and (about) the capacity it was probed with; never one a non-OOM failure
    cut short. A search that stopped at its cap answers only for that same cap (a larger one
    might go further)."""
    return (
        profile.stop_kind != "failure"
        and profile.safety_margin == safety_margin
        and abs(capacity_bytes - profile.capacity_bytes)
        <= profile.capacity_bytes * CAPACITY_TOLERANCE
        and profile.max_micro_batch_size <= search_limit
        and (profile.stop_kind != "limit" or profile.max_micro_batch_size == search_limit)
    )
