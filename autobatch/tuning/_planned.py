"""The tuning road's calls into :mod:`autobatch.planning`, all in one place: whether some plan is
possible before probing, the largest micro-batch worth a trial, the plan from a profile (one
process, or one rank of a mixed plan), and what a profile from another card plans for this
card's capacity (confirmation on arrival).

Example::

    check_possible(request.probe.max_micro_batch_size, request.plan)
    plan_from(found.profile, request.plan, budget=budget, cached=found.cached)
"""

from __future__ import annotations

from collections.abc import Sequence

from autobatch.device import MemoryBudget
from autobatch.planning import (
    Limit,
    Plan,
    PlanRequest,
    RankLimit,
    budget_margin,
    budgeted_plan,
    largest_useful_micro_batch_size,
    mixed_plans,
    plan,
    plan_request,
    resolve_plan_limit,
    stored_profile_source,
    with_budget,
    with_limit,
)
from autobatch.profile import Profile

__all__ = [
    "check_mixed_possible",
    "check_possible",
    "mixed_rank_plan",
    "mixed_useful_cap",
    "plan_at_capacity",
    "plan_from",
    "rank_limit",
    "useful_cap",
]


def check_possible(search_cap: int, wanted: PlanRequest) -> None:
    """Refuse before probing when no micro-batch up to ``search_cap`` makes a plan.

    Raises:
        NoFeasiblePlanError: names the nearest reachable sizes.
    """
    plan_request(search_cap, wanted)


def useful_cap(search_cap: int, wanted: PlanRequest) -> int:
    """``search_cap`` narrowed to ``ceil(effective_batch_size / world_size)``: sizes no plan
    for ``wanted`` can use are not worth a trial (nor the estimate's)."""
    return min(
        search_cap, largest_useful_micro_batch_size(wanted.effective_batch_size, wanted.world_size)
    )


def check_mixed_possible(search_cap: int, wanted: PlanRequest) -> None:
    """Refuse before probing when no per-rank micro-batches up to ``search_cap`` make a mixed
    plan.

    Raises:
        ConfigError, NoFeasiblePlanError: as :func:`autobatch.planning.mixed_plans`.
    """
    mixed_plans([RankLimit(max_micro_batch_size=search_cap)] * wanted.world_size, wanted)


def mixed_useful_cap(search_cap: int, wanted: PlanRequest) -> int:
    """The most one rank of a mixed plan can take: the effective batch less the least the
    others take (``multiple_of`` each), within ``search_cap``; at least 1."""
    useful = wanted.effective_batch_size - (wanted.world_size - 1) * wanted.multiple_of
    return max(1, min(search_cap, useful))


def plan_from(
    profile: Profile, wanted: PlanRequest, *, budget: MemoryBudget | None, cached: bool
) -> Plan:
    """The plan for ``wanted`` from ``profile`` within ``budget`` (a stored profile's source
    when ``cached``).

    Raises:
        NoFeasiblePlanError: no split meets the constraints.
    """
    source = stored_profile_source(profile) if cached else None
    return budgeted_plan(profile, wanted, budget=budget, source=source)


def rank_limit(profile: Profile, wanted: PlanRequest, *, cached: bool) -> tuple[Limit, RankLimit]:
    """This rank's limit for a mixed plan, from its own ``profile``, and the part of it the
    ranks share (its max micro-batch and step line)."""
    source = stored_profile_source(profile) if cached else None
    limit = resolve_plan_limit(profile, wanted, source)
    return limit, RankLimit.of(limit)


def mixed_rank_plan(
    shared: Sequence[RankLimit],
    wanted: PlanRequest,
    *,
    rank: int,
    limit: Limit,
    profile: Profile,
    budget: MemoryBudget | None,
) -> Plan:
    """Rank ``rank``'s plan of the one mixed plan over every rank's shared limit (``shared``),
    completed with its own ``limit`` and memory budget.

    Raises:
        NoFeasiblePlanError: no per-rank split meets the constraints.
    """
    result = with_limit(mixed_plans(shared, wanted)[rank], limit, profile=profile)
    if budget is not None:
        result = with_budget(result, budget, safety_margin=budget_margin(profile, wanted))
    return result


def plan_at_capacity(profile: Profile, capacity_bytes: int, *, safety_margin: float) -> Plan:
    """What a stored ``profile`` (another card's) plans within ``capacity_bytes`` at
    ``safety_margin``: its ``max_micro_batch_size`` and, past the sizes that really ran there,
    ``source == "predicted"`` with its prediction.

    Raises:
        ConfigError, NoFeasiblePlanError: the profile cannot plan within ``capacity_bytes``.
    """
    return plan(
        profile,
        effective_batch_size=1,
        capacity_bytes=capacity_bytes,
        safety_margin=safety_margin,
        source="cached",
    )
