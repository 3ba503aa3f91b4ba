"""Planning, PURE: numbers in, Plan out (no torch, no pynvml).

``planner`` splits an effective batch into micro-batches and accumulation steps for a
``request`` (:class:`PlanRequest`: what a plan needs besides its limit, checked once); ``limits``
resolves what a plan's limit is (a number, a profile, a memory line and a capacity); ``splits`` is
the search over splits; ``prediction`` predicts the largest micro-batch past what was measured;
``lines`` fits lines of peak bytes over micro-batch size (the prediction's and the probe search's);
``selection`` picks the stored profile that answers a plan for a card type or a node
(measured there, or predicted from another); ``budget`` puts the memory budget a plan was made
for on it (``fits_now``, ``trials_per_gpu``).
``epochs`` is a plan over one epoch of data (:class:`EpochPlan`, ``Plan.with_epoch``).
``mixed`` plans ranks on different cards: one accumulation count, a micro-batch per rank
(:func:`plan_mixed_ranks`, :class:`StepLine`); ``mixed_limits`` plans them from each rank's
resolved limit (:class:`RankLimit`, :func:`mixed_plans`, :func:`with_limit`).
This face is what other layers and the service import.

Example::

    from autobatch.planning import plan

    plan(24, effective_batch_size=64).micro_batch_size    # 16
"""

from __future__ import annotations

from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning._budget import (
    PlanWithTable,
    budget_margin,
    budgeted_plan,
    budgeted_table,
    given_budget,
    plan_with_table,
    with_budget,
)
from autobatch.planning._epochs import EpochPlan
from autobatch.planning._limits import Limit, PlanSource, stored_profile_source
from autobatch.planning._lines import fit_memory_model, fit_wide_line
from autobatch.planning._mixed import StepLine, plan_mixed_ranks
from autobatch.planning._mixed_limits import (
    RankLimit,
    check_mixed_request,
    mixed_plans,
    with_limit,
)
from autobatch.planning._plan import Plan, WorldSizeOption
from autobatch.planning._planner import (
    largest_useful_micro_batch_size,
    plan,
    plan_request,
    plan_table,
    plan_world_sizes,
    resolve_plan_limit,
)
from autobatch.planning._prediction import Prediction
from autobatch.planning._request import MAX_GRADIENT_ACCUMULATION_STEPS, PlanRequest, Uneven
from autobatch.planning._selection import Selection, condition_mismatches, select_profile

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "MAX_GRADIENT_ACCUMULATION_STEPS",
    "EpochPlan",
    "Limit",
    "Plan",
    "PlanRequest",
    "PlanSource",
    "PlanWithTable",
    "Prediction",
    "RankLimit",
    "Selection",
    "StepLine",
    "Uneven",
    "WorldSizeOption",
    "budget_margin",
    "budgeted_plan",
    "budgeted_table",
    "check_mixed_request",
    "condition_mismatches",
    "fit_memory_model",
    "fit_wide_line",
    "given_budget",
    "largest_useful_micro_batch_size",
    "mixed_plans",
    "plan",
    "plan_mixed_ranks",
    "plan_request",
    "plan_table",
    "plan_with_table",
    "plan_world_sizes",
    "resolve_plan_limit",
    "select_profile",
    "stored_profile_source",
    "with_budget",
    "with_limit",
]
