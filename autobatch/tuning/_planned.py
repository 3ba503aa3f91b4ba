"""The tuning road's calls into :mod:`autobatch.planning`, all in one place: whether some plan is
possible before probing, the largest micro-batch worth a trial, the plan from a profile (one
process, or one rank of a mixed plan), and what a profile from another card plans for this
card's capacity (confirmation on arrival).

Example::

    check_possible(request.probe.search_limit, request.plan)
    plan_from(found.profile, request.plan, budget=budget, cached=found.cached)
"""

from __future__ import annotations

from collections.abc import Sequence

from autobatch.device import MemoryBudget
from autobatch.planning import (
    Plan,
    PlanRequest,
    RankLimit,
    largest_useful_micro_batch_size,
    plan_mixed_ranks,
    plan_request,
    stored_profile_source,
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
        ConfigError, NoFeasiblePlanError: as :func:`autobatch.planning.plan_mixed_ranks`.
    """
    plan_mixed_ranks([RankLimit(max_micro_batch_size=search_cap)] * wanted.world_size, wanted)


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
    return plan_request(profile, wanted, budget=budget, source=source)


def rank_limit(profile: Profile, wanted: PlanRequest, *, cached: bool) -> RankLimit:
    """This rank's limit for a mixed plan, from its own ``profile`` (kept in this process: it
    completes this rank's plan); :meth:`RankLimit.shared` is the part the ranks exchange (its
    max micro-batch and step line)."""
    source = stored_profile_source(profile) if cached else None
    return RankLimit.of(profile, wanted, source=source)


def mixed_rank_plan(
    shared: Sequence[RankLimit],
    wanted: PlanRequest,
    *,
    rank: int,
    limit: RankLimit,
    budget: MemoryBudget | None,
) -> Plan:
    """Rank ``rank``'s plan of the one mixed plan over every rank's shared limit (``shared``),
    completed with its own ``limit`` (:func:`rank_limit`) and memory budget.

    Raises:
        NoFeasiblePlanError: no per-rank split meets the constraints.
    """
    ranks = list(shared)
    ranks[rank] = limit
    return plan_mixed_ranks(ranks, wanted, budget=budget)[rank]


def plan_at_capacity(profile: Profile, capacity_bytes: int, *, safety_margin: float) -> Plan:
    """What a stored ``profile`` (another card's) plans within ``capacity_bytes`` at
    ``safety_margin``: its ``max_micro_batch_size`` and, past the sizes that really ran there,
    ``source == "predicted"`` with its prediction.

    Raises:
        ConfigError, NoFeasiblePlanError: the profile cannot plan within ``capacity_bytes``.
    """
    wanted = PlanRequest(
        effective_batch_size=1, capacity_bytes=capacity_bytes, safety_margin=safety_margin
    )
    return plan_request(profile, wanted, source="cached")
