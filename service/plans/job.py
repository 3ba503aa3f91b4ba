"""``POST /v1/plan`` for a job on mixed cards (``job``: cards and counts): each card's profile of
the model, chosen as for ``card`` (:func:`service.plans.limits.select`: measured on that card, or
predicted for it), one mixed plan over every rank and each card's plan from it
(:func:`service.plans.planner.plan_job`). The store is read in a worker thread
(:func:`select_job`); the rest is arithmetic (:func:`job_answer`).

Example::

    selected = await store_call(state, select_job, body, state.store, state.central)
    public = job_answer(body, selected)    # PlanPublic's fields, ranks included
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autobatch.planning import PlanSource, Selection
from autobatch.profile import Profile
from autobatch.store import ProfileStore
from service.fleet.central import CentralProfiles
from service.plans.configs import plan_configs
from service.plans.limits import MAX_ANSWER_MICRO_BATCHES, predicted_note, select, selection_public
from service.plans.planner import JobCard, plan_job
from service.plans.schemas import JobCards, PlanCreate
from service.web.problems import Problem
from service.web.schemas import ResolvedDevice

__all__ = ["CardChoice", "job_answer", "select_job"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CardChoice:
    """One card of the job and the stored profile that answers for it."""

    entry: JobCards
    body: PlanCreate
    """The request as a plan for this card alone (``card`` set), for the selection's wording."""
    profile: Profile
    profile_id: str
    source: PlanSource
    selection: Selection
    card_bytes: int | None
    """The card's memory when the plan is predicted from a profile of another card."""


def select_job(
    body: PlanCreate, store: ProfileStore, central: CentralProfiles | None
) -> list[CardChoice]:
    """Each card's profile, in the job's order (store reads: run in a worker thread).

    Raises:
        Problem: as :func:`service.plans.limits.select`, its field naming the job's entry.
    """
    assert body.job is not None
    chosen = []
    for index, entry in enumerate(body.job):
        alone = body.model_copy(update={"card": entry.card, "job": None})
        given = entry.capacity_bytes
        device = (
            None if given is None else ResolvedDevice(source="capacity_bytes", capacity_bytes=given)
        )
        try:
            profile, profile_id, source, selection, card_bytes = select(
                alone, store, central, device
            )
        except Problem as exc:
            if exc.field == "body.card":
                exc.field = f"body.job.{index}.card"
                exc.detail = exc.detail.replace(
                    "give device.capacity_bytes", f"give job[{index}].capacity_bytes"
                )
            raise
        if given is not None:
            card_bytes = given  # the memory this card gives a rank, as the entry says
        chosen.append(
            CardChoice(
                entry=entry,
                body=alone,
                profile=profile,
                profile_id=profile_id,
                source=source,
                selection=selection,
                card_bytes=card_bytes,
            )
        )
    return chosen


def job_answer(body: PlanCreate, chosen: list[CardChoice]) -> dict[str, Any]:
    """``PlanPublic``'s fields for the job: rank 0's plan, configs (refused for a mixed plan),
    profile and selection, and ``ranks``: each card's.

    Raises:
        ConfigError, NoFeasiblePlanError: the planner's (the nearest reachable effective
            batches named).
        Problem: 422 when the answer would list more than
            :data:`~service.plans.limits.MAX_ANSWER_MICRO_BATCHES` sizes.
    """
    world_size = sum(choice.entry.count for choice in chosen)
    first_plan, card_plans = plan_job(
        body,
        [
            JobCard(
                count=choice.entry.count,
                profile=choice.profile,
                source=choice.source,
                card_bytes=choice.card_bytes,
            )
            for choice in chosen
        ],
    )
    listed = (first_plan.gradient_accumulation_steps + world_size) * (len(chosen) + 1)
    if listed > MAX_ANSWER_MICRO_BATCHES:
        raise Problem(
            422,
            "validation",
            f"the job's plans would list {listed} micro-batch sizes (at most "
            f"{MAX_ANSWER_MICRO_BATCHES} per answer); give max_gradient_accumulation_steps",
            field="body.job",
        )
    groups: list[dict[str, Any]] = []
    first = 0
    for choice, result in zip(chosen, card_plans, strict=True):
        if choice.selection.match == "predicted":
            note = predicted_note(choice.selection, choice.body)
            result = dataclasses.replace(result, notes=(*result.notes, note))
        groups.append(
            {
                "card": choice.entry.card,
                "count": choice.entry.count,
                "first_rank": first,
                "plan": result,
                "profile_id": choice.profile_id,
                "selection": selection_public(choice.selection, choice.body),
            }
        )
        first += choice.entry.count
    head = groups[0]
    return {
        "plan": head["plan"],
        "configs": plan_configs(first_plan),  # the frameworks' refusal of a mixed plan
        "world_size_options": None,
        "profile_id": head["profile_id"],
        "device": None,
        "selection": head["selection"],
        "ranks": groups,
    }
