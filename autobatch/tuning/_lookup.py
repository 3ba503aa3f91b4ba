"""The road's store lane: the profile that answers a tuning request, from the store, from a
prediction confirmed on this card, or from a probe (:func:`find_profile`).

Example::

    found = find_profile(step, options, StoreOptions(store=None, use_store=True,
                                                     refresh=False, remote=None))
    found.profile.max_micro_batch_size, found.cached
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from autobatch.conditions import condition_changes
from autobatch.distributed import (
    LocalConsensus,
    ProcessGroupConsensus,
)
from autobatch.errors import ConditionsWarning
from autobatch.probing import ProbeOptions, StepSpec, run_confirmation, run_probe
from autobatch.profile import Profile
from autobatch.store import ProfileRemote, ProfileStore
from autobatch.tuning._cache import (
    StoreOptions,
    Superseded,
    TunedProfile,
    agreed_profile,
    answers_request,
    superseded_in,
    user_stacklevel,
)
from autobatch.tuning._confirmation import (
    ArrivalPrediction,
    confirm_on_arrival,
    find_prediction,
    stored_profiles,
)

__all__ = ["find_profile", "why_probed_again"]

logger = logging.getLogger("autobatch")


def find_profile(step: StepSpec, options: ProbeOptions, storing: StoreOptions) -> TunedProfile:
    """The road's one store lane (:func:`autobatch.tuning._cache.agreed_profile`) for this step
    and these options: a stored profile that answers, else a prediction confirmed on this card
    (one process only), else a probe.

    Raises:
        As :func:`autotune_profile`.
    """
    ranks = options.consensus
    assert isinstance(ranks, ProcessGroupConsensus | LocalConsensus)  # the road makes them
    capacity_now = options.device.capacity()
    key = step.identity.cache_key(
        device_name=options.device.name,
        total_memory_bytes=capacity_now.total_memory_bytes,
        compiled=options.compiled,
        mode=options.mode,
        conditions=options.conditions,
    )
    # The capacity a profile answers for: under torch.distributed, the smallest rank's (the
    # capacity the ranks probe together).
    (searched_capacity,) = ranks.min_ints([capacity_now.capacity_bytes])

    def accepts(found: Profile) -> bool:
        return (
            answers_request(found, options.safety_margin, options.search_limit, searched_capacity)
            and not condition_changes(found.conditions, options.conditions)
            and found.gradient_sync.answers(options.gradient_sync)
        )

    def explain(store: ProfileStore) -> Superseded | None:
        found = superseded_in(
            store,
            step.identity,
            options.conditions,
            device_name=options.device.name,
            total_memory_bytes=capacity_now.total_memory_bytes,
            compiled=options.compiled,
            mode=options.mode,
        )
        return None if found is None or _another_mode_of_ours(found, options) else found

    def confirm(store: ProfileStore | None) -> tuple[Profile | None, str]:
        predicted = _prediction_here(
            store,
            step,
            options,
            total_memory_bytes=capacity_now.total_memory_bytes,
            capacity_bytes=searched_capacity,
            remote=storing.remote,
        )
        if predicted is None:
            return None, ""
        return confirm_on_arrival(
            predicted,
            lambda size, line: run_confirmation(step, options, micro_batch_size=size, prior=line),
        )

    return agreed_profile(
        ranks,
        key,
        storing,
        accepts=accepts,
        run_probe=lambda: run_probe(step, options),
        confirm=confirm if ranks.world_size == 1 else None,
        explain=explain,
    )


def why_probed_again(found: TunedProfile) -> list[str]:
    """Plan notes for a profile probed again because the stored one's conditions differ, and a
    :class:`ConditionsWarning` when activation checkpointing changed nothing."""
    if found.superseded is None:
        return []
    notes = [found.superseded.describe()]
    in_vain = found.superseded.checkpointing_in_vain(found.profile)
    if in_vain:
        warnings.warn(in_vain, ConditionsWarning, stacklevel=user_stacklevel())
        notes.append(in_vain)
    return notes


def _prediction_here(
    store: ProfileStore | None,
    step: StepSpec,
    options: ProbeOptions,
    *,
    total_memory_bytes: int,
    capacity_bytes: int,
    remote: ProfileRemote | None,
) -> ArrivalPrediction | None:
    """A plan predicted for this card from a profile of the same step on another card: from the
    store, else from ``remote`` (:mod:`autobatch.tuning._confirmation`)."""
    where: dict[str, Any] = {
        "device_name": options.device.name,
        "total_memory_bytes": total_memory_bytes,
        "capacity_bytes": capacity_bytes,
        "safety_margin": options.safety_margin,
        "search_limit": options.search_limit,
        "mode": options.mode,
        "conditions": options.conditions,
    }
    identity = step.identity
    found = find_prediction(stored_profiles(store, identity), identity, **where)
    if found is not None or remote is None:
        return found
    elsewhere, why = remote.profiles_of(identity)
    if why:
        logger.warning("%s; probing this card without it", why)
    return find_prediction(elsewhere, identity, **where)


def _another_mode_of_ours(found: Superseded, options: ProbeOptions) -> bool:
    """``found`` differs only in activation checkpointing that autobatch itself applied, to it
    or to this probe (``activation_checkpointing="auto"`` trying its modes): each mode has its
    own profile by design, so its neighbour is no news to the user. A model whose own
    checkpointing changed (a flag the user flipped) is still worth the warning."""
    ours = found.profile.activation_checkpointing != "none" or options.checkpointing_mode != "none"
    return ours and all(change.name == "activation checkpointing" for change in found.changes)
