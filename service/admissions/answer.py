"""The answer to a ``POST /v1/admissions``, as JSON bytes: each candidate card's profile of the
model (chosen as ``POST /v1/plan`` chooses it for ``card``), its plans at every GPU count the
policy allows (:func:`service.plans.planner.plan_world_sizes`), and the decision
(:func:`service.admissions.decision.decide`).

The store reads and the planning run on the store's threads with a deadline
(``service.web.store_calls``); the decision is arithmetic.

Example::

    content = await admission_answer(body, state)   # bytes of an AdmissionPublic
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic_core import to_json, to_jsonable_python

from autobatch.cli import env_variables
from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import Plan, Selection
from autobatch.store import ProfileStore
from service.admissions.decision import (
    AdmissionPolicy,
    CardOptions,
    Decision,
    counts_to_plan,
    decide,
)
from service.admissions.schemas import AdmissionCreate
from service.deps import ServiceState
from service.fleet.central import CentralProfiles
from service.plans.limits import (
    MAX_ANSWER_MICRO_BATCHES,
    check_answer_size,
    predicted_note,
    select,
    selection_public,
)
from service.plans.planner import plan_world_sizes
from service.plans.schemas import PlanCreate
from service.web.problems import Problem
from service.web.schemas import MAX_SIZE
from service.web.store_calls import store_call
from service.web.wording import describe

__all__ = ["CardPlans", "admission_answer", "card_plans", "decided", "policy_of"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CardPlans:
    """One candidate card's plans and the profile choice they came from."""

    options: CardOptions
    body: PlanCreate
    """The request as a plan for this card alone, for the selection's wording."""
    selection: Selection | None


def policy_of(body: AdmissionCreate) -> AdmissionPolicy:
    """The body's policy, as the decision takes it."""
    return AdmissionPolicy(
        size=body.policy.size,
        allowed_world_sizes=tuple(sorted(body.policy.allowed_world_sizes)),
        max_world_size=body.policy.max_world_size,
        largest_effective_batch_size=MAX_SIZE,
    )


async def admission_answer(body: AdmissionCreate, state: ServiceState) -> bytes:
    """The decision for the body's job, with the plan, its variables and the reasons.

    Raises:
        Problem: 422 for a card whose name names no card or whose memory is unknown, or an
            answer too large (``service.plans.limits.check_answer_size``); 503 when the store
            does not answer in time.
    """
    found, decision = await store_call(state, decided, body, state.store, state.central)
    chosen = next((p for p in found if p.options.card == decision.card), None)
    return to_json(_public(decision, chosen if decision.plan is not None else None))


def decided(
    body: AdmissionCreate, store: ProfileStore, central: CentralProfiles | None
) -> tuple[list[CardPlans], Decision]:
    """The cards' plans and the decision, planning only the GPU counts the answer needs (store
    reads and planning: run in a worker thread): a sized job, every allowed count; a job that
    asks a count, that count, and the allowed ones only when it reaches nothing there (the
    answer then names the counts that reach it).

    Raises:
        Problem: as :func:`card_plans`.
    """
    policy = policy_of(body)
    every = counts_to_plan(body.world_size, policy)
    asked = every if policy.size or body.world_size is None else (body.world_size,)
    found = card_plans(body, store, central, asked)
    decision = decide([p.options for p in found], world_size=body.world_size, policy=policy)
    if decision.outcome == "unreachable" and asked != every:
        found = card_plans(body, store, central, every)
        decision = decide([p.options for p in found], world_size=body.world_size, policy=policy)
    return found, decision


def card_plans(
    body: AdmissionCreate,
    store: ProfileStore,
    central: CentralProfiles | None,
    counts: tuple[int, ...],
) -> list[CardPlans]:
    """Each candidate card's plans at the GPU ``counts``, in the body's order (store reads and
    planning: run in a worker thread). A card without a profile of the model, whose memory is
    unknown, or on which the model does not fit at all, has none and says why. A plan of more
    accumulation steps than an answer lists (``MAX_ANSWER_MICRO_BATCHES``) does not reach the
    batch, so the nearest batches named can be asked and answered.

    Raises:
        Problem: 422 as :func:`service.plans.limits.select`, its field one of the admission
            body's (``body.cards.N`` for the card).
    """
    found = []
    for index, card in enumerate(body.cards or [None]):
        alone = PlanCreate(
            model_fingerprint=body.model_fingerprint,
            card=card,
            conditions=body.conditions,
            effective_batch_size=body.effective_batch_size,
            multiple_of=body.multiple_of,
            max_gradient_accumulation_steps=MAX_ANSWER_MICRO_BATCHES,
            world_sizes=list(counts),  # the asked count and at most 31 allowed ones
        )
        try:
            found.append(_one_card(alone, store, central))
        except Problem as exc:
            if exc.status != 404 and exc.slug != "unknown-card":
                exc.field = _admission_field(exc.field, index)
                raise
            why = exc.detail
            if exc.slug == "unknown-card":  # the plan route's remedy names its device field
                why = (
                    "no stored profile (of any model) was measured on this card, so its memory "
                    "is unknown; check the name against GET /v1/profiles' device_name"
                )
            missing = CardOptions(card=card, profile_id=None, missing=why)
            found.append(CardPlans(options=missing, body=alone, selection=None))
    return found


def _admission_field(field: str | None, index: int) -> str | None:
    """A plan's field as the admission body's: ``body.card`` is ``body.cards.N``; a field the
    admission body lacks is the body's as a whole."""
    if field == "body.card":
        return f"body.cards.{index}"
    path = (field or "").split(".")
    if field is None or len(path) < 2 or path[1] in AdmissionCreate.model_fields:
        return field
    return "body"


def _one_card(body: PlanCreate, store: ProfileStore, central: CentralProfiles | None) -> CardPlans:
    # with a card or without (the model alone), drawn among the nodes
    profile, profile_id, source, selection, card_bytes = select(body, store, central, None)
    try:
        rows = plan_world_sizes(body, profile, capacity_bytes=card_bytes, source=source)
    except (ConfigError, NoFeasiblePlanError) as exc:
        options = CardOptions(card=body.card, profile_id=profile_id, missing=describe(exc))
        return CardPlans(options=options, body=body, selection=selection)
    options = CardOptions(
        card=body.card,
        profile_id=profile_id,
        rows=tuple(rows),
        match=None if selection is None else selection.match,
    )
    return CardPlans(options=options, body=body, selection=selection)


def _public(decision: Decision, chosen: CardPlans | None) -> dict[str, Any]:
    """``AdmissionPublic``'s fields."""
    plan: Plan | None = decision.plan
    selection = None
    if chosen is not None and plan is not None:
        # the answer holds this plan alone: its size is the plan's (a 422 names
        # body.effective_batch_size, a field of the admission)
        check_answer_size(chosen.body.model_copy(update={"world_sizes": None}), plan)
        if chosen.selection is not None:
            selection = selection_public(chosen.selection, chosen.body)
            if chosen.selection.match == "predicted":
                note = predicted_note(chosen.selection, chosen.body)
                plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    answer: dict[str, Any] = {
        "outcome": decision.outcome,
        "card": decision.card,
        "world_size": decision.world_size,
        "plan": plan,
        "profile_id": decision.profile_id,
        "selection": selection,
        "reasons": list(decision.reasons),
        "message": "; ".join(decision.reasons),
        "nearest_effective_batch_sizes": list(decision.nearest_effective_batch_sizes),
        "reaching_world_sizes": list(decision.reaching_world_sizes),
        "environment": {},
    }
    if plan is not None:
        answer["environment"] = env_variables(to_jsonable_python(plan), answer)
    return answer
