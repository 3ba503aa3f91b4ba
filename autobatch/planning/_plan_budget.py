"""PURE: a plan and the memory budget it was made for (:class:`~autobatch.device.MemoryBudget`).

The planner plans within a number of bytes; these put the budget behind that number on the plan:
whether the plan's predicted peak fits what is free now (``fits_now``) and how many processes of
this plan fit on one card (``trials_per_gpu``, for a scheduler placing fractional jobs), and
build the budget of a size given by a caller (the CLI's ``--capacity``, the service's
``device.capacity_bytes``) with a declared ``gpu_fraction``.

The planning entries (:mod:`autobatch.planning._entries`) put a budget given to them on their
plans with :func:`with_budget`.

Example::

    budget = given_budget(24 * 2**30, gpu_fraction=0.5)      # 12 GiB, decided by gpu_fraction
    request = PlanRequest(effective_batch_size=64, capacity_bytes=budget.budget_bytes)
    plan_request(profile, request, budget=budget).budget.trials_per_gpu   # e.g. 2
"""

from __future__ import annotations

import dataclasses

from autobatch.device import (
    BudgetReading,
    BudgetSource,
    MemoryBudget,
    check_gpu_fraction,
    combine_budget,
    fraction_reading,
)
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning._plan import Plan
from autobatch.planning._request import PlanRequest
from autobatch.profile import MemoryModel, Profile

__all__ = ["budget_margin", "given_budget", "with_budget"]


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


def budget_margin(limit: int | Profile | MemoryModel, request: PlanRequest) -> float:
    """The safety margin a plan's budget is completed with (``trials_per_gpu``): the request's,
    else the profile's own, else :data:`~autobatch.margin.DEFAULT_SAFETY_MARGIN`, as the
    planner chose the limit with."""
    if request.safety_margin is not None:
        return request.safety_margin
    return limit.safety_margin if isinstance(limit, Profile) else DEFAULT_SAFETY_MARGIN
