"""Confirm on arrival: a plan predicted for this card from another card's profile is tried once.

A predicted plan (``plan.source == "predicted"``) is a pure function of a stored profile and a
capacity, so it is not stored as such: when :func:`autobatch.autotune` finds no profile for the
card it runs on, it looks in the store, then in the remote the road passed down
(:class:`~autobatch.store.ProfileRemote`; with ``report_to``, the service), for a
profile of the *same step* (the same :class:`~autobatch.profile.StepIdentity`: model, step,
input, dtypes, optimizer, torch; and the same conditions, :mod:`autobatch.conditions`) probed on
another card, and plans from it for this card's capacity. When that plan is predicted (past the
largest size that really ran there), one real trial at the predicted max micro-batch confirms
it: the confirming profile is stored for this card (later calls read it from the store; the
remote gets it too) and the plan is ``measured``. When the trial runs out of memory, or its peak
does not keep the safety margin free, a normal probe runs instead, and the
profile's notes and the ``autobatch`` logger say so.

The trial is the caller's (:func:`autobatch.probing._prober.confirm_micro_batch_size`); the
plan for this card comes from :func:`autobatch.tuning._planned.plan_at_capacity`.

Example::

    found = find_prediction(stored_profiles(store, identity), identity, device_name="NVIDIA H100",
                            total_memory_bytes=80 * 2**30, capacity_bytes=76 * 2**30,
                            safety_margin=0.05, search_limit=4096)
    found.micro_batch_size, found.profile_id      # e.g. 171, "3f9c..."
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from autobatch.conditions import Conditions, condition_changes
from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import Prediction
from autobatch.profile import MemoryModel, Mode, Profile, StepIdentity, Trial
from autobatch.store import ProfileStore
from autobatch.tuning._planned import plan_at_capacity

__all__ = [
    "ArrivalPrediction",
    "confirm_on_arrival",
    "find_prediction",
    "stored_profiles",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ArrivalPrediction:
    """A plan predicted for this card from a stored profile of the same step on another card."""

    profile_id: str
    """The stored profile the prediction comes from."""
    profile: Profile
    micro_batch_size: int
    """The predicted max micro-batch for this card (capped by the caller's limit)."""
    prediction: Prediction

    def line(self) -> MemoryModel:
        """The prediction's memory line."""
        return MemoryModel(
            fixed_bytes=self.prediction.fixed_bytes,
            bytes_per_sample=self.prediction.bytes_per_sample,
        )


def find_prediction(
    candidates: Iterable[tuple[str, Profile]],
    identity: StepIdentity,
    *,
    device_name: str,
    total_memory_bytes: int,
    capacity_bytes: int,
    safety_margin: float,
    search_limit: int,
    mode: Mode = "train",
    conditions: Conditions | None = None,
) -> ArrivalPrediction | None:
    """The predicted plan for this card from the first profile of the same step in ``candidates``.

    Args:
        candidates: ``(id, profile)`` pairs, most trusted first (e.g. :func:`stored_profiles`,
            then the remote's, :meth:`~autobatch.store.ProfileRemote.profiles_of`);
            profiles of other steps, and of this card, are skipped.
        identity: this request's step (:func:`autobatch.probing._identity.step_identity`).
        device_name, total_memory_bytes: this card (with ``identity``, the cache key).
        capacity_bytes: bytes the step may use on this card.
        safety_margin: fraction of ``capacity_bytes`` kept free.
        search_limit: the caller's search cap; the predicted size is capped by it.
        conditions: the live process's (:attr:`Profile.conditions`); a profile measured under
            other conditions that move memory (:func:`autobatch.conditions.condition_changes`)
            predicts nothing here. None: not compared.
        mode: what the caller measures (:attr:`Profile.mode`); only profiles of that mode
            count. The planner predicts training steps only, so ``"eval"`` finds none (an
            evaluation fits more than the training step the profile shares its identity with).

    Returns:
        The prediction, or None when no profile of this step on another card predicts past its
        measured sizes here (none, an estimate, a line that cannot be trusted, or a plan within
        the measured sizes).
    """
    card = (device_name, total_memory_bytes)
    for profile_id, profile in candidates:
        if profile.method == "estimate" or profile.stop_kind == "failure" or profile.mode != mode:
            continue
        elsewhere = (profile.device_name, profile.total_memory_bytes) != card
        if profile.identity != identity or not elsewhere:
            continue
        if conditions is not None and condition_changes(profile.conditions, conditions):
            continue
        try:
            result = plan_at_capacity(profile, capacity_bytes, safety_margin=safety_margin)
        except (ConfigError, NoFeasiblePlanError):
            continue  # this profile cannot predict here; an older one might
        if result.prediction is None or result.source != "predicted":
            return None  # the first profile of this step answers within its measured sizes
        return ArrivalPrediction(
            profile_id=profile_id,
            profile=profile,
            micro_batch_size=min(result.max_micro_batch_size, search_limit),
            prediction=result.prediction,
        )
    return None


def confirm_on_arrival(
    found: ArrivalPrediction, run_trial: Callable[[int, MemoryModel], tuple[Trial, Profile | None]]
) -> tuple[Profile | None, str]:
    """Run the confirming trial; the profile for this card (None when the prediction failed) and
    a note saying what happened.

    Args:
        found: from :func:`find_prediction`.
        run_trial: one real trial at a size with the prediction's line (warm-up included), e.g.
            :func:`autobatch.probing._prober.run_confirmation` bound to the step and options.
    """
    size = found.micro_batch_size
    origin = (
        f"micro-batch {size} predicted for this card from profile {found.profile_id} "
        f"({found.profile.device_name}, largest measured "
        f"{found.prediction.largest_measured_micro_batch_size})"
    )
    trial, confirmed = run_trial(size, found.line())
    if confirmed is not None:
        note = f"{origin}: confirmed by one real trial (peak {trial.peak_reserved_bytes} bytes)"
        return dataclasses.replace(confirmed, notes=(*confirmed.notes, note)), note
    why = trial.error or (
        f"its peak {trial.peak_reserved_bytes} bytes does not keep the safety margin free"
    )
    return None, f"{origin}: the confirming trial failed ({why}); probed this card instead"


def stored_profiles(
    store: ProfileStore | None, identity: StepIdentity
) -> list[tuple[str, Profile]]:
    """The store's profiles of this step's model, newest first (none without a store).

    Raises:
        StoreError: the store is unreadable.
    """
    if store is None:
        return []
    return store.list_profiles(model_fingerprint=identity.model_fingerprint)
