"""PURE: a plan and the memory budget it was made for (:class:`~autobatch.device.MemoryBudget`).

The planner plans within a number of bytes; these put the budget behind that number on the plan:
whether the plan's predicted peak fits what is free now (``fits_now``) and how many processes of
this plan fit on one card (``trials_per_gpu``, for a scheduler placing fractional jobs), and
build the budget of a size given by a caller (the CLI's ``--capacity``, the service's
``device.capacity_bytes``) with a declared ``gpu_fraction``.

The sequence plan -> budget -> world-size table lives here, once (:func:`budgeted_plan`,
:func:`budgeted_table`, :func:`plan_with_table`): the CLI's ``plan``, ``POST /v1/plan`` and the
tuning road call it.

Example::

    budget = given_budget(24 * 2**30, gpu_fraction=0.5)      # 12 GiB, decided by gpu_fraction
    request = PlanRequest(effective_batch_size=64, capacity_bytes=budget.budget_bytes)
    budgeted_plan(profile, request, budget=budget).budget.trials_per_gpu   # e.g. 2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autobatch.device import (
    BudgetReading,
    BudgetSource,
    MemoryBudget,
    check_gpu_fraction,
    combine_budget,
    fraction_reading,
)
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning._limits import PlanSource
from autobatch.planning._plan import Plan, WorldSizeOption
from autobatch.planning._planner import plan_request, plan_table
from autobatch.planning._request import PlanRequest
from autobatch.profile import MemoryModel, Profile

__all__ = [
    "PlanWithTable",
    "budget_margin",
    "budgeted_plan",
    "budgeted_table",
    "given_budget",
    "plan_with_table",
    "with_budget",
]


def with_budget(result: Plan, budget: MemoryBudget, *, safety_margin: float) -> Plan:
    """``result`` with ``budget`` on it, completed for its predicted peak (``fits_now``,
    ``trials_per_gpu``; see :meth:`MemoryBudget.for_peak`)."""
    peak = result.predicted_peak_memory_bytes
    return dataclasses.replace(result, budget=budget.for_peak(peak, safety_margin=safety_margin))


def given_budget(
    capacity_bytes: int,
    *,
    gpu_fraction: float | None = None,
    source: BudgetSource = "capacity_bytes",
    detail: str = "given by the caller",
) -> MemoryBudget:
    """The budget of a card of ``capacity_bytes`` named by the caller (``source``: a size given,
    or node labels read), with the declared ``gpu_fraction`` of it if any.

    Raises:
        ConfigError: ``gpu_fraction`` is not in (0, 1], or ``capacity_bytes`` is negative.
    """
    fraction = check_gpu_fraction(gpu_fraction)
    readings = [
        BudgetReading(
            source=source,
            total_bytes=capacity_bytes,
            available_bytes=capacity_bytes,
            detail=detail,
        )
    ]
    if fraction is not None:
        readings.append(
            fraction_reading(
                "gpu_fraction", fraction, capacity_bytes, f"gpu_fraction={fraction} declared"
            )
        )
    return combine_budget(readings)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanWithTable:
    """What :func:`plan_with_table` gives: the plan at the request's world size and, with
    ``world_sizes``, the table; both with the budget on them when one was given."""

    plan: Plan
    """The plan at ``request.world_size``."""
    world_size_options: list[WorldSizeOption] | None
    """One row per ``request.world_sizes``; None when the request has none."""


def budget_margin(limit: int | Profile | MemoryModel, request: PlanRequest) -> float:
    """The safety margin a plan's budget is completed with (``trials_per_gpu``): the request's,
    else the profile's own, else :data:`~autobatch.margin.DEFAULT_SAFETY_MARGIN`, as the
    planner chose the limit with."""
    if request.safety_margin is not None:
        return request.safety_margin
    return limit.safety_margin if isinstance(limit, Profile) else DEFAULT_SAFETY_MARGIN


def budgeted_plan(
    limit: int | Profile | MemoryModel,
    request: PlanRequest,
    *,
    budget: MemoryBudget | None = None,
    source: PlanSource | None = None,
) -> Plan:
    """:func:`~autobatch.planning.plan_request`, with ``budget`` on the plan (when given).

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`autobatch.plan`.
    """
    result = plan_request(limit, request, source=source)
    if budget is None:
        return result
    return with_budget(result, budget, safety_margin=budget_margin(limit, request))


def budgeted_table(
    limit: int | Profile | MemoryModel,
    request: PlanRequest,
    *,
    budget: MemoryBudget | None = None,
    source: PlanSource | None = None,
) -> list[WorldSizeOption]:
    """:func:`~autobatch.planning.plan_table`, with ``budget`` on every row's plan (when given).

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`autobatch.plan_world_sizes`.
    """
    rows = plan_table(limit, request, source=source)
    if budget is None:
        return rows
    margin = budget_margin(limit, request)
    return [
        dataclasses.replace(row, plan=with_budget(row.plan, budget, safety_margin=margin))
        if row.plan is not None
        else row
        for row in rows
    ]


def plan_with_table(
    limit: int | Profile | MemoryModel,
    request: PlanRequest,
    *,
    budget: MemoryBudget | None = None,
    source: PlanSource | None = None,
    check_table: Callable[[Plan], None] | None = None,
) -> PlanWithTable:
    """The plan at ``request.world_size`` and, with ``request.world_sizes``, the table, each with
    ``budget`` on it: plan, then budget, then table.

    Args:
        limit, request, budget, source: as for :func:`budgeted_plan`.
        check_table: called with the plan before the table is planned (the service refuses a
            table whose answer would be too large to send), raising to refuse it.

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`autobatch.plan`; whatever
            ``check_table`` raises.
    """
    result = budgeted_plan(limit, request, budget=budget, source=source)
    if request.world_sizes is None:
        return PlanWithTable(plan=result, world_size_options=None)
    if check_table is not None:
        check_table(result)
    rows = budgeted_table(limit, request, budget=budget, source=source)
    return PlanWithTable(plan=result, world_size_options=rows)
