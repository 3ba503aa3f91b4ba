"""Planning, PURE: numbers in, Plan out (no torch, no pynvml).

One entry per question, each taking the request (:class:`PlanRequest`: what a plan needs
besides its limit, checked once when it is built) and, optionally, the memory budget the plan
is made for:

- :func:`plan_request`: one plan within a limit (a number, a Profile or a memory model);
- :func:`plan_table`: a table of plans over candidate data-parallel sizes (world sizes);
- :func:`plan_mixed_ranks`: a plan per rank for ranks on mixed cards (:class:`RankLimit` each).

These are pure: :func:`autobatch.plan` and :func:`autobatch.plan_world_sizes` are their keyword
builders for users, and ``autobatch.plan`` then checks the plan against the training process
that calls it. Beside the entries: the Plan and its parts, the options' declaration
(:class:`SplitOptions`, :class:`PlanOptions`), the budget of a given capacity
(:func:`given_budget`), the selection of a stored profile for a card or a node
(:func:`select_profile`), whether a profile sent by another process adds up
(:func:`check_arrival`), and the memory lines the probe search fits (:func:`fit_memory_model`,
:func:`fit_wide_line`). This face is what other layers and the service import.

Example::

    from autobatch.planning import PlanRequest, plan_request

    plan_request(24, PlanRequest(effective_batch_size=64)).micro_batch_size    # 16
"""

from __future__ import annotations

from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning._arrival import (
    ARRIVAL_TOLERANCE,
    Discrepancy,
    check_arrival,
    uncatalogued_note,
)
from autobatch.planning._checkpointing import (
    AskedCheckpointing,
    CheckpointingChoice,
    ModeMeasurement,
    checkpointing_modes_to_try,
    choose_checkpointing,
    timing_noise,
)
from autobatch.planning._entries import plan_mixed_ranks, plan_request, plan_table
from autobatch.planning._epochs import EpochPlan
from autobatch.planning._limits import PlanSource, stored_profile_source
from autobatch.planning._lines import fit_memory_model, fit_wide_line
from autobatch.planning._mixed import StepLine
from autobatch.planning._mixed_limits import RankLimit
from autobatch.planning._plan import Plan, WorldSizeOption
from autobatch.planning._plan_budget import given_budget
from autobatch.planning._planner import largest_useful_micro_batch_size
from autobatch.planning._prediction import Prediction
from autobatch.planning._report_data import mode_report, profile_report
from autobatch.planning._request import (
    MAX_GRADIENT_ACCUMULATION_STEPS,
    PlanOptions,
    PlanRequest,
    SplitOptions,
    Uneven,
)
from autobatch.planning._selection import Match, Selection, condition_mismatches, select_profile

__all__ = [
    "ARRIVAL_TOLERANCE",
    "DEFAULT_SAFETY_MARGIN",
    "MAX_GRADIENT_ACCUMULATION_STEPS",
    "AskedCheckpointing",
    "CheckpointingChoice",
    "Discrepancy",
    "EpochPlan",
    "Match",
    "ModeMeasurement",
    "Plan",
    "PlanOptions",
    "PlanRequest",
    "PlanSource",
    "Prediction",
    "RankLimit",
    "Selection",
    "SplitOptions",
    "StepLine",
    "Uneven",
    "WorldSizeOption",
    "check_arrival",
    "checkpointing_modes_to_try",
    "choose_checkpointing",
    "condition_mismatches",
    "fit_memory_model",
    "fit_wide_line",
    "given_budget",
    "largest_useful_micro_batch_size",
    "mode_report",
    "plan_mixed_ranks",
    "plan_request",
    "plan_table",
    "profile_report",
    "select_profile",
    "stored_profile_source",
    "timing_noise",
    "uncatalogued_note",
]
