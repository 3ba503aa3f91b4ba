"""Which stored profile (or number, or memory line) answers a ``POST /v1/plan``, and the
answer's parts that come from that choice.

One job: from a :class:`~service.plans.schemas.PlanCreate`, the limit the planner plans within
(:func:`resolve_limit`: a plain max micro-batch size, a memory model, a profile by id) or, for
a model (``model_fingerprint``, by card type, by node or alone), the profile drawn among the
nodes' stored ones, from this node's store or the central service's (:func:`select`, by
:func:`service.plans.planner.chooser`); the note and the public selection that go with a
choice; and the cap on the size of an answer, its plan and ``world_sizes`` table
(:func:`check_answer_size`). Store reads block: the route runs these in a worker thread
(``service.web.store_calls``).

Example::

    profile, profile_id, source, selection, card_bytes = select(
        body, state.store, state.central, device
    )
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, get_args

from autobatch.device import card_key, catalogue_memory_bytes
from autobatch.errors import ConfigError, ProfileDeletedError, ProfileNotFoundError
from autobatch.planning import MAX_GRADIENT_ACCUMULATION_STEPS, Plan, PlanSource, Selection
from autobatch.profile import CheckpointingMode, MemoryModel, Profile
from autobatch.store import ProfileStore
from service.fleet.central import CentralProfiles
from service.plans.planner import Chooser, checkpointing_choice, chooser, source_of
from service.plans.schemas import PlanCreate
from service.web.problems import Problem, unknown_profile
from service.web.schemas import ResolvedDevice
from service.web.wording import describe

__all__ = [
    "asked_mode",
    "in_mode",
    "MAX_ANSWER_MICRO_BATCHES",
    "NAME_SCAN",
    "NODE_PROFILES",
    "card_profiles",
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
    body: PlanCreate, store: ProfileStore | None, device: ResolvedDevice | None
) -> tuple[int | Profile | MemoryModel, str | None, PlanSource | None]:
    """(limit for the planner, profile id used, plan source to report or None for the
    planner's default) of a body that names a ``profile_id``, a ``max_micro_batch_size`` or a
    ``memory_model``; ``store`` is read for a ``profile_id`` (None: the body names none). A
    ``model_fingerprint`` is drawn among the nodes by :func:`select`.

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
        return profile, body.profile_id, source_of(profile)
    raise AssertionError("a plan by model_fingerprint is drawn by select")


def _of_mode(
    body: PlanCreate, every: list[tuple[str, Profile]], choose: Chooser
) -> Selection | None:
    """For ``activation_checkpointing`` ``"auto"``: the profile drawn among the nodes under
    each mode (``choose`` over each mode's profiles of ``every``), the one
    :func:`~service.plans.planner.checkpointing_choice` chooses; None when no mode answers."""
    drawn: dict[str, Selection] = {}
    for mode in sorted({profile.activation_checkpointing for _, profile in every}):
        chosen = choose(in_mode(every, mode))
        if chosen is not None:
            drawn[mode] = chosen
    newest = {mode: (chosen.profile_id, chosen.profile) for mode, chosen in drawn.items()}
    found = checkpointing_choice(body, newest)
    return None if found is None else drawn[found[1].activation_checkpointing]


def asked_mode(body: PlanCreate) -> str:
    """The activation checkpointing mode the body's job trains under: its
    ``activation_checkpointing``, else its ``conditions``' ``activation_checkpointing``, else
    ``"none"`` (the model as given: a job that names no mode imposes none, so only a profile
    measured without checkpointing may plan it)."""
    if body.activation_checkpointing is not None:
        return body.activation_checkpointing
    said = (body.conditions or {}).get("activation_checkpointing")
    return said if isinstance(said, str) else "none"


def in_mode(found: list[tuple[str, Profile]], mode: str) -> list[tuple[str, Profile]]:
    """The profiles of ``found`` measured under the activation checkpointing ``mode`` (all of
    them for ``"auto"``, which chooses among modes), in their order."""
    if mode == "auto":
        return found
    return [(i, profile) for i, profile in found if profile.activation_checkpointing == mode]


def _no_profile_of_mode(
    fingerprint: str, mode: str, field: str, every: list[tuple[str, Profile]]
) -> Problem:
    """The 404 for a model whose stored training profiles (among ``every``) were all measured
    under other modes than ``mode``, naming those modes."""
    stored = sorted({p.activation_checkpointing for _, p in every if p.mode == "train"})
    return Problem(
        404,
        "unknown-profile",
        f"no stored training profile of model_fingerprint {fingerprint!r} was measured under "
        f"activation_checkpointing {mode!r} (stored modes: {', '.join(stored) or 'none'}), the "
        "mode the job trains under (a job that names none trains without checkpointing, and a "
        "micro-batch measured under another mode may not fit it); probe the model under it "
        "(autobatch tune --activation-checkpointing), or name the mode the job trains with "
        "(activation_checkpointing, or conditions' activation_checkpointing)",
        field=field,
    )


NAME_SCAN = 200
"""Summaries (indexed columns, nothing decoded) read to find the names a card was stored under
(:func:`card_profiles`): the model's newest, or the store's newest for a card's memory."""
NODE_PROFILES = 1000
"""Profiles read at most for a plan of a model (by card, node or alone), here or, on a node
holding none of the model, from the central service: each node's latest per thing it measured
(``ProfileStore.latest_per_node``), newest first, so a node's flood of profiles pushes no other
node out; only those measured on the card asked about are decoded, then (for a prediction, or
a plan by the model alone without a card) the model's others."""


def card_profiles(
    store: ProfileStore, key: str, *, model_fingerprint: str | None, limit: int
) -> list[tuple[str, Profile]]:
    """The stored profiles measured on the card ``key`` (:func:`autobatch.device.card_key`),
    of one model when given, whatever name form each was stored under: the names among the
    newest :data:`NAME_SCAN` summaries that are the card, then up to ``limit`` profiles of
    each name, newest first."""
    page = store.list_summaries(model_fingerprint=model_fingerprint, limit=NAME_SCAN)
    names = sorted({s.device_name for s in page.summaries if _card_key(s.device_name) == key})
    return [
        found
        for name in names
        for found in store.list_profiles(
            model_fingerprint=model_fingerprint, device_name=name, limit=limit
        )
    ]


def select(
    body: PlanCreate,
    store: ProfileStore,
    central: CentralProfiles | None,
    device: ResolvedDevice | None,
) -> tuple[Profile, str, PlanSource, Selection, int | None]:
    """A plan's profile for ``body.model_fingerprint`` (:mod:`autobatch.planning._selection`):
    (profile, its id, plan source, the selection, the memory to plan for in bytes when the
    plan is predicted for a card other than the profile's or scaled to a share of the card,
    else None). ``device`` (the request's, resolved) is the budget asked.

    A node holding none of the model asks the central service (:func:`_from_central`; not
    for ``activation_checkpointing`` ``"auto"``, which draws under each mode here).
    For ``body.card``/``body.node``, as they ask. For the model alone (no card, no node), the
    same draw among the nodes, for the card the request's device names, else among the
    profiles of the card the most nodes measured the model on (:func:`most_measured`): no
    node's newest profile decides it.

    Raises:
        Problem: 404 when no stored training profile of the model may answer; 422 when the
            card's name names no card, or its memory is unknown (no profile of any model
            measured on it, and no device given).
    """
    assert body.model_fingerprint is not None
    if body.activation_checkpointing == "auto" and (body.card or body.node) is not None:
        return _select_auto(body, store, central, device)
    mig_profile = None if body.device is None else body.device.mig_profile
    card = body.card
    alone = body.card is None and body.node is None
    if alone and device is not None and device.name and _card_key(device.name) is not None:
        card = device.name
    try:
        key = None if card is None else card_key(card, mig_profile)
    except ConfigError as exc:
        raise Problem(422, "validation", describe(exc), field="body.card") from None
    budget_bytes = None if device is None else device.capacity_bytes
    choose = chooser(body, card=card, budget_bytes=budget_bytes, mig_profile=mig_profile)
    if alone and key is None:
        choose = most_measured(choose)
    fingerprint, mode = body.model_fingerprint, asked_mode(body)
    try:
        chosen, seen, every = None, [], []
        if key is not None:
            every = store.latest_per_node(
                model_fingerprint=fingerprint, limit=NODE_PROFILES, card=_names_of(key)
            )
            seen = in_mode(every, mode)
            chosen = choose(seen)
        if chosen is None or chosen.match == "predicted":
            every = store.latest_per_node(model_fingerprint=fingerprint, limit=NODE_PROFILES)
            seen = in_mode(every, mode)
            chosen = choose(seen)
        if chosen is None and not _trains(every) and mode != "auto":  # ask central
            every, chosen = _from_central(store, central, fingerprint, choose, mode)
            seen = in_mode(every, mode)
        if alone and mode == "auto":
            chosen = _of_mode(body, seen, choose)
    except ConfigError as exc:
        raise Problem(422, "validation", describe(exc), field="body.conditions") from None
    if chosen is None and _trains(every) and not _trains(seen):
        field = "body.conditions" if body.activation_checkpointing is None else _ASKED_MODE
        raise _no_profile_of_mode(fingerprint, mode, field, every)
    if chosen is None:
        raise _none_answers(body, seen)
    profile = chosen.profile
    card_bytes = chosen.budget_bytes
    if not chosen.same_card and key is not None and device is None:
        card_bytes = _card_memory(store, key, card, profile)
    return profile, chosen.profile_id, source_of(profile), chosen, card_bytes


def most_measured(choose: Chooser) -> Chooser:
    """``choose`` among the training profiles of the card the most nodes measured (each node
    counted once, whatever it published; then the card measured with the most memory, then
    the first card key): a plan by model alone is drawn among one card's nodes. A card whose
    profiles cannot answer (all measured under shares, for a whole card) gives way to the
    next in that order."""

    def chosen(found: Sequence[tuple[str, Profile]]) -> Selection | None:
        by_card: dict[str, list[tuple[str, Profile]]] = {}
        for entry in found:  # each profile's card key read once
            by_card.setdefault(_card_key(entry[1].device_name) or entry[1].device_name, []).append(
                entry
            )
        trained = {
            key: [p for _, p in entries if p.mode == "train"] for key, entries in by_card.items()
        }
        standing = {
            key: (-len({p.node_name for p in ps}), -max(p.total_memory_bytes for p in ps), key)
            for key, ps in trained.items()
            if ps
        }
        if not standing:
            return choose(found)
        for top in sorted(standing, key=standing.__getitem__):
            selection = choose(by_card[top])
            if selection is not None:  # None: e.g. only shares of that card, for a whole card
                return selection
        return None

    return chosen


_ASKED_MODE = "body.activation_checkpointing"


def _select_auto(
    body: PlanCreate,
    store: ProfileStore,
    central: CentralProfiles | None,
    device: ResolvedDevice | None,
) -> tuple[Profile, str, PlanSource, Selection, int | None]:
    """:func:`select` for ``activation_checkpointing`` ``"auto"``: each mode's profile chosen
    for the card or node as :func:`select` chooses it (drawn among the nodes), then among the
    modes as :func:`~service.plans.planner.checkpointing_choice` chooses (each mode planned
    for the card's memory when predicted for it), as the fingerprint-only path does.

    Raises:
        Problem: 404 naming ``body.activation_checkpointing`` when no mode's profile answers
            or none plans the effective batch; 422 as :func:`select`, except a mode whose
            profile cannot be planned for the card asked (its memory unknown, 422
            ``unknown-card``): that mode is skipped and named in the selection's notes, and
            its 422 comes back only when no mode answers.
    """
    answers: dict[str, tuple[Profile, str, PlanSource, Selection, int | None]] = {}
    missing: list[str] = []
    unplannable: dict[str, Problem] = {}
    for mode in get_args(CheckpointingMode):  # least recompute first
        try:
            answers[mode] = select(
                body.model_copy(update={"activation_checkpointing": mode}), store, central, device
            )
        except Problem as exc:
            if exc.status == 422 and exc.slug == "unknown-card":
                unplannable[mode] = exc  # this mode's profile cannot be planned for the card
                continue
            if exc.status != 404:
                raise
            missing.append(mode)
    if not answers and unplannable:
        raise next(iter(unplannable.values()))
    capacities = {mode: answer[4] for mode, answer in answers.items()}
    budget = None if device is None else device.capacity_bytes
    chosen = checkpointing_choice(
        body,
        {mode: (answer[1], answer[0]) for mode, answer in answers.items()},
        capacity_bytes={mode: budget or given for mode, given in capacities.items()},
    )
    if chosen is None:
        asked = " and ".join(
            f"{name} {value!r}"
            for name, value in (("card", body.card), ("node", body.node))
            if value is not None
        )
        why = f"no stored profile of {', '.join(missing)} answers there" if missing else ""
        if len(missing) < len(get_args(CheckpointingMode)):
            why += ("; " if why else "") + "no stored mode's plan reaches the effective batch"
        raise Problem(
            404,
            "unknown-profile",
            f"no stored training profile of model_fingerprint {body.model_fingerprint!r} "
            f"answers activation_checkpointing 'auto' for {asked} ({why}); probe the model "
            "there (autobatch tune --activation-checkpointing auto) or ask one mode",
            field=_ASKED_MODE,
        )
    profile, profile_id, source, selection, card_bytes = answers[chosen[1].activation_checkpointing]
    skipped = tuple(
        f"activation checkpointing {mode} skipped: {problem.detail}"
        for mode, problem in unplannable.items()
    )
    selection = dataclasses.replace(selection, notes=(*selection.notes, *skipped))
    return profile, profile_id, source, selection, card_bytes


def _card_memory(store: ProfileStore, key: str, card: str | None, profile: Profile) -> int:
    """The memory of the card ``key`` in bytes: autobatch's catalogue's
    (:func:`autobatch.device.catalogue_memory_bytes`), below it what profiles measured on the
    card recorded (ECC on a GDDR card takes some); for a card the catalogue does not hold, what
    those profiles recorded (their card's name and memory as NVML reported them).

    Raises:
        Problem: 422 when the catalogue does not hold the card and no stored profile was
            measured on it.
    """
    known = catalogue_memory_bytes(key)
    on_card = card_profiles(store, key, model_fingerprint=None, limit=1)
    if on_card:
        recorded = max(found.total_memory_bytes for _, found in on_card)
        return recorded if known is None else min(known, recorded)
    if known is not None:
        return known
    raise Problem(
        422,
        "unknown-card",
        f"card {card!r} is not in autobatch's catalogue and no stored profile (of any model) "
        f"was measured on it, so its memory is unknown and the profile measured on "
        f"{profile.device_name} cannot be scaled to it: give device.capacity_bytes (the "
        "card's memory in bytes), or check the card's name against GET /v1/profiles' "
        "device_name",
        field="body.card",
    )


def _none_answers(body: PlanCreate, seen: list[tuple[str, Profile]]) -> Problem:
    """The 404 for a plan no stored profile may answer, saying why: no training profile of the
    model; or only profiles measured under a share of a card, asked for a whole card; or only
    profiles of cards autobatch's catalogue does not hold, asked for another card."""
    asked = " and ".join(
        f"{name} {value!r}"
        for name, value in (("card", body.card), ("node", body.node))
        if value is not None
    )
    trained = [profile for _, profile in seen if profile.mode == "train"]
    if not asked and not trained:
        return Problem(
            404,
            "unknown-profile",
            f"no stored profile has model_fingerprint {body.model_fingerprint!r} (the hash in "
            "a profile's model_fingerprint field, as GET /v1/profiles and a finished probe job "
            "show it; not a registry model name), or only evaluation profiles; register one "
            "with POST /v1/profiles or run a probe",
            field="body.model_fingerprint",
        )
    asked = asked or "a plan by model_fingerprint alone"
    key = None if body.card is None else _card_key(body.card)
    unchecked = [
        p
        for p in trained
        if catalogue_memory_bytes(p.device_name) is None and _card_key(p.device_name) != key
    ]
    if trained and (len(unchecked) < len(trained) or key is None):
        why = (
            f"the stored training profiles of model_fingerprint {body.model_fingerprint!r} were "
            f"measured under a share of a card (time-sliced, fractional, virtualised, or with "
            f"memory held by others), and a share never answers for a whole card ({asked}): "
            "give device (capacity_bytes, node_labels or gpu_fraction) for the share the job "
            "gets, or publish a profile measured on the whole card"
        )
    elif trained:
        names = sorted({profile.device_name for profile in unchecked})
        cards = " or ".join(json.dumps(name) for name in names)
        why = (
            f"no stored training profile of model_fingerprint {body.model_fingerprint!r} can "
            f"answer for {asked}: they were all measured on {', '.join(map(repr, names))}, a "
            "card autobatch's catalogue does not list, so its memory cannot be checked and "
            "they predict for no other card. To plan for it: probe the model on that card and "
            "publish the profile (autobatch tune --report-to URL there, or POST /v1/profiles); "
            f'or ask for "card": {cards}, which they answer as measured'
        )
    else:
        why = (
            f"no stored training profile has model_fingerprint {body.model_fingerprint!r}, so "
            f"nothing can plan it for {asked}, measured or predicted; publish one (POST "
            "/v1/profiles, autobatch tune --report-to URL, or a probe on a node whose sidecar "
            "reports here)"
        )
    return Problem(404, "unknown-profile", why, field="body.model_fingerprint")


def _trains(found: list[tuple[str, Profile]]) -> bool:
    return any(profile.mode == "train" for _, profile in found)


def _names_of(key: str) -> Callable[[str], bool]:
    """Whether a stored card name names the card ``key``, each distinct name read once."""
    seen: dict[str, bool] = {}

    def names(name: str) -> bool:
        if name not in seen:
            seen[name] = _card_key(name) == key
        return seen[name]

    return names


def _card_key(name: str) -> str | None:
    """``name``'s card key; None for a name that names no card."""
    try:
        return card_key(name)
    except ConfigError:
        return None


def _from_central(
    store: ProfileStore,
    central: CentralProfiles | None,
    model_fingerprint: str,
    choose: Chooser,
    mode: str,
) -> tuple[list[tuple[str, Profile]], Selection | None]:
    """Node mode, for a model this node's store does not hold: the central service's profiles
    of it, one per node and thing measured (:meth:`CentralProfiles.latest_per_node`: what
    central's own plan draws from, so a node that floods central crowds no other out), and the
    one ``choose`` draws among those of the activation checkpointing ``mode`` (the same draw
    as central's), kept in this node's store. ``([], None)`` without a central service or when
    it does not answer; ``(found, None)`` when none answers for the plan, or when the node
    follows the chosen one's deletion already (its store refuses the copy)."""
    if central is None:
        return [], None
    found = central.latest_per_node(model_fingerprint, limit=NODE_PROFILES)
    chosen = choose(in_mode(found, mode)) if found else None
    if chosen is None:
        return found, None
    try:
        kept = store.put(chosen.profile)
    except ProfileDeletedError:  # deleted at central since the fetch (its tombstone followed)
        return found, None
    if kept != chosen.profile_id:  # a row central keeps under its old (version 1) id
        considered = tuple(sorted(kept if i == chosen.profile_id else i for i in chosen.considered))
        chosen = dataclasses.replace(chosen, profile_id=kept, considered=considered)
    return found, chosen


def predicted_note(chosen: Selection, body: PlanCreate) -> str:
    """The note of a plan from a profile measured elsewhere (``match`` ``"predicted"``)."""
    target = body.card or (f"node {body.node}" if body.node else "the card asked about")
    return (
        f"predicted for {target}, not measured there: planned from profile {chosen.profile_id} "
        f"({'; '.join(chosen.reasons)}); one real trial on that card confirms it"
    )


def selection_public(chosen: Selection, body: PlanCreate) -> dict[str, Any]:
    """``SelectionPublic``: which stored profile answered, why it is not ``measured``, and
    which agreeing profiles it was chosen among."""
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
        "considered": list(chosen.considered),
        "max_micro_batch_size_range": list(chosen.max_micro_batch_size_range),
        "basis": chosen.basis,
        "outliers": list(chosen.outliers),
        "rests_on": chosen.rests_on,
        "lower_bounds": list(chosen.lower_bounds),
        "measured_under": chosen.measured_under,
        "measured_max_micro_batch_size": profile.max_micro_batch_size,
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
