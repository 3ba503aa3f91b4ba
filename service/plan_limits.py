"""Which stored profile (or number, or memory line) answers a ``POST /v1/plan``, and the
answer's parts that come from that choice.

One job: from a :class:`~service.schemas.PlanCreate`, the limit the planner plans within
(:func:`resolve_limit`: a plain max micro-batch size, a memory model, a profile by id or by
fingerprint, from this node's store or the central service's) or, for a card type or a node,
the profile chosen among a model's stored ones (:func:`select`, by
:func:`autobatch.planning.select_profile`); the note and the public selection that go with a
choice; and the cap on the size of an answer, its plan and ``world_sizes`` table
(:func:`check_answer_size`). Store reads block: the route runs these in a worker thread
(``service.store_calls``).

Example::

    limit, profile_id, source = resolve_limit(body, state.store, state.central, device)
"""

from __future__ import annotations

from typing import Any

from autobatch.errors import ConfigError, ProfileNotFoundError
from autobatch.planning import (
    MAX_GRADIENT_ACCUMULATION_STEPS,
    Plan,
    PlanSource,
    Selection,
    select_profile,
    stored_profile_source,
)
from autobatch.profile import MemoryModel, Profile
from autobatch.profiles import ProfileStore
from service.central import CentralProfiles
from service.problems import Problem, unknown_profile
from service.schemas import PlanCreate, ResolvedDevice

__all__ = [
    "ANY_CANDIDATES",
    "CARD_CANDIDATES",
    "MAX_ANSWER_MICRO_BATCHES",
    "check_answer_size",
    "predicted_note",
    "resolve_limit",
    "select",
    "selection_public",
]

MAX_ANSWER_MICRO_BATCHES = MAX_GRADIENT_ACCUMULATION_STEPS // 4
"""Micro-batch sizes one answer may list over its plan and ``world_sizes`` table (262,144:
about 2 MB of JSON at most; a plan of 100,000 steps, which the CLI plans, is still answered).
Below the planner's own bound on one plan (``MAX_GRADIENT_ACCUMULATION_STEPS``, 2**20), which
a library caller may still plan."""


def resolve_limit(
    body: PlanCreate,
    store: ProfileStore | None,
    central: CentralProfiles | None,
    device: ResolvedDevice | None,
) -> tuple[int | Profile | MemoryModel, str | None, PlanSource | None]:
    """(limit for the planner, profile id used, plan source to report or None for the
    planner's default). ``store`` is read for a ``profile_id`` or ``model_fingerprint`` (None:
    the body names neither), ``central`` after it for a fingerprint this store lacks.

    Raises:
        Problem: 422 for a limit that does not go with the device or margin asked; 404 for a
            profile that is not stored.
    """
    if body.max_micro_batch_size is not None:
        if device is not None or body.safety_margin is not None:
            raise Problem(
                422,
                "validation",
                "a plain max_micro_batch_size takes no device or safety_margin; to plan for a "
                "device's memory give a profile_id, model_fingerprint or memory_model",
                field="body.device" if device is not None else "body.safety_margin",
            )
        return body.max_micro_batch_size, None, None
    if body.memory_model is not None:
        if device is None:
            raise Problem(
                422, "validation", "a memory_model needs a device to plan for", field="body.device"
            )
        return MemoryModel(**body.memory_model.model_dump()), None, None
    assert store is not None  # the body names a stored profile
    if body.profile_id is not None:
        try:
            profile = store.get(body.profile_id)
        except ProfileNotFoundError:
            raise unknown_profile(body.profile_id, field="body.profile_id") from None
        return profile, body.profile_id, stored_profile_source(profile)
    assert body.model_fingerprint is not None
    found = []
    if device is not None and device.name:
        found = store.list_profiles(
            model_fingerprint=body.model_fingerprint, device_name=device.name, limit=1
        )
    found = found or store.list_profiles(model_fingerprint=body.model_fingerprint, limit=1)
    if not found:
        found = _from_central(
            store, central, body.model_fingerprint, None if device is None else device.name
        )
    if not found:
        raise Problem(
            404,
            "unknown-profile",
            f"no stored profile has model_fingerprint {body.model_fingerprint!r} (the hash in a "
            "profile's model_fingerprint field, as GET /v1/profiles and a finished probe job "
            "show it; not a registry model name); register one with POST /v1/profiles or run "
            "a probe",
            field="body.model_fingerprint",
        )
    profile_id, profile = found[0]
    return profile, profile_id, stored_profile_source(profile)


CARD_CANDIDATES = (2, 8, 50)
"""Profiles of the model on the card asked about read per request (newest first) to find one
under the conditions asked, in growing pages: the newest 2 (one of them usually answers, and
decoding each profile costs about 70 µs on 2 cores), then 8, then 50; past them, the model's
newest :data:`ANY_CANDIDATES` of any card."""
ANY_CANDIDATES = 200


def select(
    body: PlanCreate, store: ProfileStore, central: CentralProfiles | None
) -> tuple[Profile, str, PlanSource, Selection, int | None]:
    """A plan's profile for ``body.card``/``body.node`` (:mod:`autobatch.planning.selection`):
    (profile, its id, plan source, the selection, the card's memory in bytes when the plan is
    predicted for a card other than the profile's, else None).

    Raises:
        Problem: 404 when the store has no training profile of the model; 422 when the card's
            memory is unknown (no profile of any model measured on it, and no device given).
    """
    assert body.model_fingerprint is not None
    wanted = body.conditions or {}
    try:
        chosen = None
        if body.card is not None and body.node is None:
            for limit in CARD_CANDIDATES:
                on_card = store.list_profiles(
                    model_fingerprint=body.model_fingerprint, device_name=body.card, limit=limit
                )
                chosen = select_profile(on_card, card=body.card, node=None, conditions=wanted)
                if len(on_card) < limit or (chosen is not None and chosen.match != "predicted"):
                    break
        if chosen is None or chosen.match == "predicted":
            candidates = store.list_profiles(
                model_fingerprint=body.model_fingerprint, limit=ANY_CANDIDATES
            )
            chosen = select_profile(candidates, card=body.card, node=body.node, conditions=wanted)
        if chosen is None:
            fetched = _from_central(store, central, body.model_fingerprint, body.card)
            chosen = select_profile(fetched, card=body.card, node=body.node, conditions=wanted)
    except ConfigError as exc:
        raise Problem(422, "validation", str(exc), field="body.conditions") from None
    if chosen is None:
        asked = " and ".join(
            f"{name} {value!r}"
            for name, value in (("card", body.card), ("node", body.node))
            if value is not None
        )
        raise Problem(
            404,
            "unknown-profile",
            f"no stored training profile has model_fingerprint {body.model_fingerprint!r}, so "
            f"nothing can plan it for {asked}, measured or predicted; publish one (POST "
            "/v1/profiles, autobatch tune --report-to URL, or a probe on a node whose sidecar "
            "reports here)",
            field="body.model_fingerprint",
        )
    profile = chosen.profile
    card_bytes = None
    if not chosen.same_card and body.card is not None and body.device is None:
        on_card = store.list_profiles(device_name=body.card, limit=1)
        if not on_card:
            raise Problem(
                422,
                "unknown-card",
                f"no stored profile (of any model) was measured on card {body.card!r}, so its "
                f"memory is unknown and the profile measured on {profile.device_name} cannot be "
                "scaled to it: give device.capacity_bytes (the card's memory in bytes), or "
                "check the card's name against GET /v1/profiles' device_name",
                field="body.card",
            )
        card_bytes = on_card[0][1].total_memory_bytes
    return profile, chosen.profile_id, stored_profile_source(profile), chosen, card_bytes


def _from_central(
    store: ProfileStore, central: CentralProfiles | None, model_fingerprint: str, card: str | None
) -> list[tuple[str, Profile]]:
    """Node mode, for a model this node's store does not hold: the central service's profile
    of it for ``card`` (:mod:`service.central`), kept in this node's store; empty without a
    central service, or when it holds none or does not answer."""
    if central is None:
        return []
    fetched = central.fetch(model_fingerprint, card=card)
    if fetched is None:
        return []
    _central_id, profile = fetched
    return [(store.put(profile), profile)]


def predicted_note(chosen: Selection, body: PlanCreate) -> str:
    """The note of a plan from a profile measured elsewhere (``match`` ``"predicted"``)."""
    target = body.card or (f"node {body.node}" if body.node else "the card asked about")
    return (
        f"predicted for {target}, not measured there: planned from profile {chosen.profile_id} "
        f"({'; '.join(chosen.reasons)}); one real trial on that card confirms it"
    )


def selection_public(chosen: Selection, body: PlanCreate) -> dict[str, Any]:
    """``SelectionPublic``: which stored profile answered, and why it is not ``measured``."""
    profile = chosen.profile
    card = body.card
    if card is None and chosen.match != "predicted":
        card = profile.device_name
    return {
        "match": chosen.match,
        "profile_id": chosen.profile_id,
        "node_name": profile.node_name,
        "device_name": profile.device_name,
        "card": card,
        "reasons": list(chosen.reasons),
    }


def check_answer_size(body: PlanCreate, result: Plan) -> None:
    """Refuse an answer whose plan and ``world_sizes`` table would list more than
    :data:`MAX_ANSWER_MICRO_BATCHES` micro-batch sizes in all: before the table is planned, and
    for a plan alone once it is.

    Each plan lists one size per accumulation step (up to 2**20 of them), so a short request
    (an effective batch of 2**20 from a micro-batch limit of 1, over a few world sizes) asked
    for megabytes of answer. The table's count is a lower bound: each row has at least
    ``ceil(E / (W * M))`` steps, ``M`` the plan's limit.

    Raises:
        Problem: 422, naming ``world_sizes`` (or ``effective_batch_size`` for a plan alone)
            and the fixes.
    """
    effective, limit = body.effective_batch_size, result.max_micro_batch_size
    least = result.gradient_accumulation_steps + sum(
        -(-effective // (world_size * limit))
        for world_size in body.world_sizes or ()
        if body.allow_inexact or effective % world_size == 0
    )
    if least <= MAX_ANSWER_MICRO_BATCHES:
        return
    if body.world_sizes is None:
        raise Problem(
            422,
            "validation",
            f"the plan would list {least} micro-batch sizes (one per accumulation step; at most "
            f"{MAX_ANSWER_MICRO_BATCHES} per answer): ask a smaller effective_batch_size, or "
            "plan from a larger max_micro_batch_size",
            field="body.effective_batch_size",
        )
    raise Problem(
        422,
        "validation",
        f"the plan and world_sizes table would list at least {least} micro-batch sizes (one "
        f"per accumulation step of each plan; at most {MAX_ANSWER_MICRO_BATCHES} per "
        "answer): ask fewer world_sizes, or plan from a larger max_micro_batch_size",
        field="body.world_sizes",
    )
