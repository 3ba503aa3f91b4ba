"""PURE: the planning entries, one per question, each taking the request whole.

- :func:`plan_request`: one plan, for ``request.world_size`` ranks on one kind of card.
- :func:`plan_table`: one row per candidate data-parallel size (``request.world_sizes``), for a
  scheduler choosing N GPUs.
- :func:`plan_mixed_ranks`: a plan per rank for ranks on cards of different memory or speed.

Each plans within a limit (a number, a :class:`~autobatch.profile.Profile` or a
:class:`~autobatch.profile.MemoryModel`; a mixed plan one per rank, :class:`RankLimit`) and
puts the memory ``budget`` it was made for on its plans when one is given. None checks the
request again: :class:`PlanRequest` checked it when it was built. These are pure: for a plan
checked against the training process that runs it, call :func:`autobatch.plan`.

Example::

    request = PlanRequest(effective_batch_size=64)
    plan_request(24, request).micro_batch_size                      # 16
    [row.world_size for row in plan_table(24, PlanRequest(effective_batch_size=64,
                                                          world_sizes=(1, 2)))]  # [1, 2]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autobatch.device import MemoryBudget
from autobatch.errors import ConfigError
from autobatch.planning._limits import PlanSource
from autobatch.planning._mixed import split_ranks
from autobatch.planning._mixed_limits import RankLimit, completed
from autobatch.planning._plan import Plan, WorldSizeOption
from autobatch.planning._plan_budget import budget_margin, with_budget
from autobatch.planning._planner import plan_within, resolve_plan_limit, table_within
from autobatch.planning._request import PlanRequest
from autobatch.profile import MemoryModel, Profile

__all__ = ["plan_mixed_ranks", "plan_request", "plan_table"]


def plan_request(
    limit: int | Profile | MemoryModel,
    request: PlanRequest,
    *,
    budget: MemoryBudget | None = None,
    source: PlanSource | None = None,
) -> Plan:
    """Plan micro-batches and accumulation steps that reach ``request.effective_batch_size`` on
    ``request.world_size`` ranks (``request.world_sizes`` is :func:`plan_table`'s).

    Args:
        limit: the largest micro-batch that may run per device (an int >= 1); a
            :class:`~autobatch.profile.Profile`, whose ``recommended_micro_batch_size`` is used
            (or, with ``request.capacity_bytes``, the largest size its measured peaks put under
            that capacity: read off the peaks within the measured sizes, predicted past them);
            or a :class:`~autobatch.profile.MemoryModel` (a peak-bytes line) with
            ``request.capacity_bytes``.
        request: the effective batch, the ranks, the options and what to plan for.
        budget: the memory budget the plan is made for, put on it (``fits_now``,
            ``trials_per_gpu``); None for none.
        source: where ``limit`` came from, said by the caller that knows: ``"measured"`` (a
            probe just run), ``"cached"`` (a profile read from a store), ``"estimated"`` or
            ``"given"``. Default: ``"estimated"`` for an estimate's profile, ``"measured"`` for
            another profile, ``"given"`` for a number or a memory model. The planner alone
            turns it into ``"predicted"`` when a profile's limit lies outside its measured
            sizes (an estimate's stays ``"estimated"``, with the prediction attached).

    Returns:
        The :class:`~autobatch.planning.Plan`.

    Raises:
        ConfigError: no plan reaches the effective batch size for a reason an argument can fix:
            ``effective_batch_size`` not a multiple of ``world_size`` (the message names the
            nearest reachable values); a ``source`` that is unknown, ``"predicted"`` or
            ``"measured"``/``"cached"`` for an estimate; a number with ``capacity_bytes`` or
            ``safety_margin``; or a profile that cannot predict for ``capacity_bytes``: peaks
            that do not grow with the micro-batch, are not on a line, or were measured at fewer
            than two sizes without a memory model (probe on that card).
        NoFeasiblePlanError: no split meets every constraint (the message names the nearest
            reachable effective batch sizes below and above), or the model does not fit at
            micro-batch 1 in ``capacity_bytes``.
    """
    result = plan_within(resolve_plan_limit(limit, request, source), request, limit)
    if budget is None:
        return result
    return with_budget(result, budget, safety_margin=budget_margin(limit, request))


def plan_table(
    limit: int | Profile | MemoryModel,
    request: PlanRequest,
    *,
    budget: MemoryBudget | None = None,
    source: PlanSource | None = None,
) -> list[WorldSizeOption]:
    """Plan ``request.effective_batch_size`` at each of ``request.world_sizes``, for a
    scheduler choosing N GPUs (``request.world_size`` is not used).

    Args:
        limit, budget, source: as for :func:`plan_request`; ``budget`` goes on every row's plan.
        request: as for :func:`plan_request`, with the candidate world sizes.

    Returns:
        One :class:`~autobatch.planning.WorldSizeOption` per world size, in the request's
        order: the plan, or the reason it is infeasible there (``effective_batch_size`` not a
        multiple of it, fewer samples than ranks, or no split meets the constraints); none
        when the request has no ``world_sizes``.

    Raises:
        ConfigError: the limit or ``source`` is invalid (as for :func:`plan_request`).
        NoFeasiblePlanError: the model does not fit at micro-batch 1 in ``capacity_bytes`` (no
            world size helps).
    """
    rows = table_within(resolve_plan_limit(limit, request, source), request, limit)
    if budget is None:
        return rows
    margin = budget_margin(limit, request)
    return [
        dataclasses.replace(row, plan=with_budget(row.plan, budget, safety_margin=margin))
        if row.plan is not None
        else row
        for row in rows
    ]


def plan_mixed_ranks(
    ranks: Sequence[RankLimit],
    request: PlanRequest,
    *,
    budget: MemoryBudget | None = None,
) -> tuple[Plan, ...]:
    """Plan one ``gradient_accumulation_steps`` for every rank and a micro-batch per rank
    (ranks on cards of different memory or speed), meeting ``request.effective_batch_size``
    exactly: ``gradient_accumulation_steps * sum(rank_micro_batch_sizes)``. Planned by time
    (the least time per optimizer step) when every rank has a step line, else by memory alone
    (the fewest accumulation steps, micro-batches in proportion to the ranks' maxima).

    Args:
        ranks: each rank's limit, in rank order, one per rank of ``request.world_size``
            (:meth:`RankLimit.of` for a rank whose limit this process resolved, or
            ``RankLimit(max_micro_batch_size=..., step_line=...)`` for one known by numbers).
        request: the effective batch, ``world_size`` (the number of ranks), ``multiple_of`` and
            ``max_gradient_accumulation_steps``.
        budget: this process's memory budget, put on the plan of each rank whose limit it
            resolved; None for none.

    Returns:
        One :class:`~autobatch.planning.Plan` per rank, in rank order: the same
        ``gradient_accumulation_steps`` and ``rank_micro_batch_sizes``, its own
        ``micro_batch_size`` and ``max_micro_batch_size``;
        ``predicted_seconds_per_effective_batch`` is the job's time per optimizer step (the
        slowest rank's micro-steps), None without step lines. A rank resolved here also has its
        own limit's peak bytes, capacity, source, conditions and notes.

    Raises:
        ConfigError: ``request`` asks for what a mixed plan does not do
            (:meth:`PlanRequest.check_mixed_ranks`), or its ``world_size`` is not
            ``len(ranks)``.
        NoFeasiblePlanError: ``multiple_of`` exceeds a rank's maximum, or no accumulation count
            and split meet the effective batch exactly; the message and the remedies name the
            nearest effective batch sizes that can be met, below and above.
    """
    request.check_mixed_ranks()
    if request.world_size != len(ranks):
        raise ConfigError(
            f"world_size {request.world_size} is not the number of ranks planned, {len(ranks)}; "
            "give one limit per data-parallel rank"
        )
    lines = [rank.step_line for rank in ranks]
    plans = split_ranks(
        [rank.max_micro_batch_size for rank in ranks],
        None if any(line is None for line in lines) else [line for line in lines if line],
        request,
    )
    return tuple(
        completed(plan, rank, request, budget) for plan, rank in zip(plans, ranks, strict=True)
    )
