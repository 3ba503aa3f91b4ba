"""The plans feature's one door into :mod:`autobatch.planning`: every planner call the service
makes is a function here, each taking the request's body (a
:class:`~service.plans.schemas.PlanCreate`) rather than the planner's own arguments.

Pure: numbers in, plans out (no store, no NVML); the callers read the store and the GPU first.

Example::

    planned = plan_and_table(
        body, limit, capacity_bytes=80 * 2**30, budget=None, source=None, check_plan=print
    )
    planned.plan.micro_batch_size
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

from autobatch.device import MemoryBudget
from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import (
    ModeMeasurement,
    Plan,
    PlanRequest,
    PlanSource,
    RankLimit,
    Selection,
    WorldSizeOption,
    choose_checkpointing,
    given_budget,
    plan_mixed_ranks,
    plan_request,
    plan_table,
    select_profile,
    stored_profile_source,
    timing_noise,
)
from autobatch.profile import MemoryModel, Profile
from service.plans.schemas import PlanCreate

__all__ = [
    "Chooser",
    "JobCard",
    "Planned",
    "checkpointing_choice",
    "chooser",
    "declared_budget",
    "plan_and_table",
    "plan_job",
    "plan_world_sizes",
    "source_of",
]

Chooser = Callable[[Sequence[tuple[str, Profile]]], Selection | None]
"""The planner's choice among ``(profile id, profile)`` candidates for one request's card, node
and conditions (:func:`chooser`); None when none may answer."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """A plan and, when the request asked for one, its table over world sizes."""

    plan: Plan
    world_size_options: list[WorldSizeOption] | None


def _request(body: PlanCreate, *, plain: bool, capacity_bytes: int | None) -> PlanRequest:
    """The planner's request of ``body``; a plain limit takes neither capacity nor margin."""
    return PlanRequest(
        effective_batch_size=body.effective_batch_size,
        world_size=body.world_size,
        world_sizes=None if body.world_sizes is None else tuple(body.world_sizes),
        multiple_of=body.multiple_of,
        max_gradient_accumulation_steps=body.max_gradient_accumulation_steps,
        uneven=body.uneven,
        allow_inexact=body.allow_inexact,
        safety_margin=None if plain else body.safety_margin,
        capacity_bytes=None if plain else capacity_bytes,
    )


def plan_and_table(
    body: PlanCreate,
    limit: int | Profile | MemoryModel,
    *,
    capacity_bytes: int | None,
    budget: MemoryBudget | None,
    source: PlanSource | None,
    check_plan: Callable[[Plan], None],
) -> Planned:
    """The plan at the body's data-parallel size and, with ``world_sizes``, the table.

    Args:
        body: the request.
        limit: a plain max micro-batch size, a stored profile or a memory model.
        capacity_bytes: the device's memory in bytes (None: no device); a plain limit plans
            with neither capacity nor margin.
        budget: the device's memory budget, shown on the plan.
        source: the limit's source to report; None for the planner's default.
        check_plan: called on the plan as soon as it is made, before any table (a size cap).

    Raises:
        ConfigError, NoFeasiblePlanError: the planner's, as for ``autobatch.plan``.
    """
    plain = isinstance(limit, int)
    request = _request(body, plain=plain, capacity_bytes=capacity_bytes)
    result = plan_request(limit, request, budget=budget, source=source)
    check_plan(result)
    if request.world_sizes is None:
        return Planned(plan=result, world_size_options=None)
    table = plan_table(limit, request, budget=budget, source=source)
    return Planned(plan=result, world_size_options=table)


def plan_world_sizes(
    body: PlanCreate,
    limit: Profile,
    *,
    capacity_bytes: int | None,
    source: PlanSource | None,
) -> list[WorldSizeOption]:
    """The body's effective batch planned at each of ``body.world_sizes`` (a scheduler's
    choice of GPU count), without the plan at ``body.world_size``.

    Raises:
        ConfigError, NoFeasiblePlanError: as :func:`autobatch.planning.plan_table` (the model
            does not fit at micro-batch 1 in ``capacity_bytes``; a profile that cannot predict
            for it).
    """
    assert body.world_sizes is not None
    request = PlanRequest(
        effective_batch_size=body.effective_batch_size,
        world_sizes=tuple(body.world_sizes),
        multiple_of=body.multiple_of,
        max_gradient_accumulation_steps=body.max_gradient_accumulation_steps,
        safety_margin=body.safety_margin,
        capacity_bytes=capacity_bytes,
    )
    return plan_table(limit, request, source=source)


def checkpointing_choice(
    body: PlanCreate,
    newest: Mapping[str, tuple[str, Profile]],
    *,
    capacity_bytes: Mapping[str, int | None] | None = None,
) -> tuple[str, Profile] | None:
    """Among the newest stored profile of each activation checkpointing mode (``newest``, by
    mode), the one :func:`autobatch.planning.choose_checkpointing` chooses for the body's
    effective batch (each planned within its own recommended size, or for the memory in bytes
    ``capacity_bytes`` gives its mode: a card it was not measured on, a budget asked); None
    when none plans."""
    measured = []
    for mode, (_, profile) in newest.items():
        capacity = None if capacity_bytes is None else capacity_bytes.get(mode)
        try:
            result = plan_request(profile, _request(body, plain=False, capacity_bytes=capacity))
        except (ConfigError, NoFeasiblePlanError):
            measured.append(
                ModeMeasurement(mode=profile.activation_checkpointing, max_micro_batch_size=0)
            )
            continue
        measured.append(_measurement(profile, result))
    choice = choose_checkpointing(measured)
    return None if choice is None else newest[choice.mode]


def _measurement(profile: Profile, result: Plan) -> ModeMeasurement:
    peaks: dict[int, int] = {}
    for trial in profile.trials:
        if trial.fits and not trial.warm_up:
            size = trial.micro_batch_size
            peaks[size] = max(peaks.get(size, 0), trial.peak_allocated_bytes)
    return ModeMeasurement(
        mode=profile.activation_checkpointing,
        max_micro_batch_size=profile.max_micro_batch_size,
        micro_batch_size=result.micro_batch_size,
        gradient_accumulation_steps=result.gradient_accumulation_steps,
        seconds_per_optimizer_step=result.predicted_seconds_per_effective_batch,
        seconds_noise=timing_noise(profile.trials, result.micro_batch_size),
        peak_memory_bytes=peaks,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobCard:
    """One entry of a job of cards, as the planner needs it."""

    count: int
    """Data-parallel ranks on this card."""
    profile: Profile
    source: PlanSource
    card_bytes: int | None
    """The card's memory in bytes when it is not the profile's own; None otherwise."""


def plan_job(body: PlanCreate, cards: Sequence[JobCard]) -> tuple[Plan, list[Plan]]:
    """A job of mixed cards: rank 0's plan as the planner gives it (the frameworks' configs
    are built from it) and one plan per card, in ``cards``' order, with that card's own limit
    on it (its predicted peak, capacity, source and notes).

    Raises:
        ConfigError, NoFeasiblePlanError: the planner's (the nearest reachable effective
            batches named).
    """
    request = PlanRequest(
        effective_batch_size=body.effective_batch_size,
        world_size=sum(card.count for card in cards),
        multiple_of=body.multiple_of,
        max_gradient_accumulation_steps=body.max_gradient_accumulation_steps,
        safety_margin=body.safety_margin,
    )
    limits = [
        RankLimit.of(
            card.profile,
            dataclasses.replace(request, capacity_bytes=card.card_bytes),
            source=card.source,
        )
        for card in cards
    ]
    # Each card's first rank holds the card's own limit, which completes that card's plan.
    ranks = [
        limit if index == 0 else limit.shared()
        for card, limit in zip(cards, limits, strict=True)
        for index in range(card.count)
    ]
    plans = plan_mixed_ranks(ranks, request)
    groups: list[Plan] = []
    first = 0
    for card in cards:
        groups.append(plans[first])
        first += card.count
    return plans[0], groups


def declared_budget(capacity_bytes: int, *, gpu_fraction: float | None) -> MemoryBudget:
    """The budget of a device given by its size in bytes, at the declared ``gpu_fraction``.

    Raises:
        ConfigError: a fraction outside (0, 1].
    """
    return given_budget(capacity_bytes, gpu_fraction=gpu_fraction)


def chooser(
    body: PlanCreate, *, card: str | None, budget_bytes: int | None, mig_profile: str | None
) -> Chooser:
    """The planner's choice of a profile for ``card`` (the body's, or the card its device
    names), the body's node and conditions, with the budget asked in bytes (None: no
    device)."""
    return functools.partial(
        select_profile,
        card=card,
        node=body.node,
        conditions=body.conditions or {},
        budget_bytes=budget_bytes,
        mig_profile=mig_profile,
    )


def source_of(profile: Profile) -> PlanSource:
    """The source a plan from a stored ``profile`` reports (``cached`` or ``estimated``)."""
    return stored_profile_source(profile)
