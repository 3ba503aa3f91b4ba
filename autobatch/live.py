"""The public keyword plan functions: :func:`plan` (``autobatch.plan``) and
:func:`plan_world_sizes` (``autobatch.plan_world_sizes``).

Each builds the one :class:`~autobatch.planning.PlanRequest` from its keywords (options declared
once, :class:`~autobatch.planning.SplitOptions` and :class:`~autobatch.planning.PlanOptions`) and
hands it to the pure planning entry (:func:`~autobatch.planning.plan_request`,
:func:`~autobatch.planning.plan_table`). What differs: :func:`plan` then checks its plan against
the training process that calls it, when that process has loaded torch (it runs steps; a
scheduler that plans without torch is not checked and does not load it):

- for a plan from a Profile, for the card it measured (no ``capacity_bytes``): the profile's
  conditions that can be read without the model (allocator settings in effect, cuDNN flags) are
  compared with this process's (:func:`autobatch.conditions.condition_changes`);
- without ``world_size``: the plan's single rank is compared with the data-parallel size the
  launcher (``WORLD_SIZE``) or the default process group says.

Each difference is a :class:`~autobatch.errors.ConditionsWarning` and a note of the plan,
naming the condition, both values and the fix. The service and the CLI plan with
:mod:`autobatch.planning`'s entries, for jobs in other processes, and are not checked.

Example::

    plan = autobatch.plan(profile, effective_batch_size=256)  # warns if cudnn.benchmark differs
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Sequence
from typing import Unpack

from autobatch.conditions import Conditions, condition_changes
from autobatch.errors import ConditionsWarning
from autobatch.planning import (
    Plan,
    PlanOptions,
    PlanRequest,
    PlanSource,
    SplitOptions,
    WorldSizeOption,
    plan_request,
    plan_table,
)
from autobatch.profile import MemoryModel, Profile

__all__ = ["plan", "plan_world_sizes"]


def plan(
    limit: int | Profile | MemoryModel,
    *,
    effective_batch_size: int,
    source: PlanSource | None = None,
    **options: Unpack[PlanOptions],
) -> Plan:
    """Plan micro-batches and accumulation steps that reach ``effective_batch_size``, and
    check the plan against this process.

    Args:
        limit: the largest micro-batch that may run per device (an int >= 1), a
            :class:`~autobatch.profile.Profile` or a :class:`~autobatch.profile.MemoryModel`
            (as for :func:`autobatch.planning.plan_request`).
        effective_batch_size: samples per optimizer step over all ranks, a positive multiple of
            ``world_size``.
        source: where ``limit`` came from (as for :func:`autobatch.planning.plan_request`).
        **options: the :class:`~autobatch.planning.PlanRequest` fields of
            :class:`~autobatch.planning.PlanOptions`: ``world_size`` (data-parallel ranks,
            default 1), ``multiple_of``, ``max_gradient_accumulation_steps``, ``uneven``,
            ``allow_inexact``, ``safety_margin``, ``capacity_bytes``, ``step_seconds``; each
            means what the request's field of that name means.

    Returns:
        The :class:`~autobatch.planning.Plan`, with a note per condition of this process that
        differs from the plan's (see the module).

    Raises:
        ConfigError: an argument is invalid (named with its value; the limit's refusal comes
            before the batch sizes'), or no plan reaches the effective batch size for a reason
            an argument can fix (as for :func:`autobatch.planning.plan_request`).
        NoFeasiblePlanError: as for :func:`autobatch.planning.plan_request`.
    """
    request = PlanRequest.for_limit(
        limit, source=source, effective_batch_size=effective_batch_size, **options
    )
    result = plan_request(limit, request, source=source)
    if "torch" not in sys.modules:
        return result
    changes = _changes_here(
        result,
        for_this_card=request.capacity_bytes is None,
        world_size_given="world_size" in options,
    )
    for change in changes:
        warnings.warn(
            f"the plan does not hold in this process: {change}", ConditionsWarning, stacklevel=2
        )
    return dataclasses.replace(result, notes=(*result.notes, *changes)) if changes else result


def plan_world_sizes(
    limit: int | Profile | MemoryModel,
    *,
    effective_batch_size: int,
    world_sizes: Sequence[int],
    source: PlanSource | None = None,
    **options: Unpack[SplitOptions],
) -> list[WorldSizeOption]:
    """Plan ``effective_batch_size`` at each of ``world_sizes``, for a scheduler choosing N GPUs
    (not checked against this process: the job runs elsewhere).

    Args:
        limit, effective_batch_size, source: as for :func:`plan`.
        world_sizes: candidate numbers of ranks, e.g. ``[1, 2, 4, 8]``; rows keep this order.
        **options: the :class:`~autobatch.planning.PlanRequest` fields of
            :class:`~autobatch.planning.SplitOptions` (:func:`plan`'s, without ``world_size``).

    Returns:
        One :class:`~autobatch.planning.WorldSizeOption` per world size: the plan, or the reason
        it is infeasible there (``effective_batch_size`` not a multiple of it, or no split meets
        the constraints).

    Raises:
        ConfigError: an argument that does not depend on the world size is invalid, or a world
            size is not an int >= 1.
        NoFeasiblePlanError: the model does not fit at micro-batch 1 in ``capacity_bytes`` (no
            world size helps).
    """
    request = PlanRequest.for_limit(
        limit,
        source=source,
        effective_batch_size=effective_batch_size,
        world_sizes=world_sizes,
        **options,
    )
    return plan_table(limit, request, source=source)


def _changes_here(result: Plan, *, for_this_card: bool, world_size_given: bool) -> list[str]:
    # torch-bound: read only in a process that has loaded torch; importing this module stays
    # torch-free
    from autobatch.probing import live_world_size, process_conditions

    live = process_conditions(sourced_world_size=live_world_size())
    recorded = result.conditions if for_this_card else Conditions()
    changes = condition_changes(
        recorded, live, world_size=None if world_size_given else result.world_size
    )
    return [change.describe() for change in changes]
