"""PURE: each rank's limit for a mixed plan (:class:`RankLimit`), and each rank's plan completed
with what its own limit knows.

The ranks of a job on mixed cards each resolve their own limit (a profile measured on their own
card, or one predicted for it: :meth:`RankLimit.of`). What the mixed plan needs of every rank is
small and plain (its largest micro-batch and its step line), so ranks can share it
(``autotune(mixed_ranks=True)`` all-gathers :meth:`RankLimit.shared`, the service builds one per
card); the process that resolved a rank's limit holds it too, and that rank's plan gets its own
peak bytes, capacity, source and prediction back from it (:func:`completed`).

Example::

    request = PlanRequest(effective_batch_size=96, world_size=2)
    ranks = [RankLimit.of(p, request, source="cached") for p in (profile_80gb, profile_40gb)]
    plan_mixed_ranks(ranks, request)[1].predicted_peak_memory_bytes
"""

from __future__ import annotations

import dataclasses

from autobatch.device import MemoryBudget
from autobatch.planning._limits import Limit, PlanSource, require_int
from autobatch.planning._mixed import StepLine
from autobatch.planning._plan import Plan
from autobatch.planning._plan_budget import budget_margin, with_budget
from autobatch.planning._planner import resolve_plan_limit
from autobatch.planning._request import PlanRequest
from autobatch.profile import MemoryModel, Profile

__all__ = ["RankLimit", "completed"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Own:
    """A rank's resolved limit and what it was resolved from, in the process that resolved it."""

    limit: Limit
    planned_from: int | Profile | MemoryModel


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankLimit:
    """What a mixed plan needs of one rank: its largest micro-batch and its step line.

    Built from plain numbers (a rank known by them alone: another process's, the CLI's
    ``--rank-max``), or by :meth:`of` from the rank's own limit, which it then also holds (not
    compared, not shared) to complete that rank's plan.
    """

    max_micro_batch_size: int
    """The largest micro-batch this rank may run (its own limit), >= 1."""
    step_line: StepLine | None = None
    """This rank's step time by micro-batch size; None without two sizes timed."""
    _own: _Own | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        require_int("max_micro_batch_size", self.max_micro_batch_size, 1)

    @classmethod
    def of(
        cls,
        limit: int | Profile | MemoryModel,
        request: PlanRequest,
        *,
        source: PlanSource | None = None,
    ) -> RankLimit:
        """This rank's limit: ``limit`` resolved for ``request`` (its ``capacity_bytes`` and
        ``safety_margin``: this rank's card), and the step line :meth:`StepLine.fit` draws
        through the mean timing of each size the profile's fitting trials timed (the warm-up
        left out); no line with fewer than two sizes timed.

        Args:
            limit: as for :func:`~autobatch.planning.plan_request`.
            request: what to plan for on this rank's card.
            source: as for :func:`~autobatch.planning.plan_request`.

        Raises:
            ConfigError, NoFeasiblePlanError: the limit cannot be resolved (as for
                :func:`~autobatch.planning.plan_request`).
        """
        resolved = resolve_plan_limit(limit, request, source)
        timings = None if resolved.step_time is None else resolved.step_time.timings
        line = None
        if timings is not None and len(timings) >= 2:
            line = StepLine.fit({size: sum(t) / len(t) for size, t in timings.items()})
        rank = cls(max_micro_batch_size=resolved.max_micro_batch_size, step_line=line)
        object.__setattr__(rank, "_own", _Own(resolved, limit))
        return rank

    def shared(self) -> RankLimit:
        """The numbers other ranks need, without this process's own limit (which does not
        pickle): what ranks exchange."""
        return RankLimit(max_micro_batch_size=self.max_micro_batch_size, step_line=self.step_line)


def completed(
    plan: Plan, rank: RankLimit, request: PlanRequest, budget: MemoryBudget | None
) -> Plan:
    """``plan`` (``rank``'s, of a mixed plan) with what ``rank``'s own limit says of it, when
    this process resolved it (:meth:`RankLimit.of`): the predicted peak bytes at its
    micro-batch, the capacity and headroom, the source (``predicted`` with its prediction, when
    the limit is one), the conditions, the limit's notes first, the gradient-sync mode and the
    activation checkpointing mode of its profile, and ``budget`` on it. A rank known by its
    numbers alone keeps ``plan``."""
    own = rank._own
    if own is None:
        return plan
    limit, planned_from = own.limit, own.planned_from
    peak = limit.peak_bytes(plan.micro_batch_size)
    capacity = limit.capacity_bytes
    result = dataclasses.replace(
        plan,
        predicted_peak_memory_bytes=peak,
        capacity_bytes=capacity,
        headroom_bytes=None if peak is None or capacity is None else capacity - peak,
        source=limit.source,
        prediction=limit.prediction,
        conditions=limit.conditions,
        notes=(*limit.notes, *plan.notes),
        gradient_sync=(
            planned_from.gradient_sync if isinstance(planned_from, Profile) else plan.gradient_sync
        ),
        activation_checkpointing=(
            planned_from.activation_checkpointing
            if isinstance(planned_from, Profile)
            else plan.activation_checkpointing
        ),
    )
    if budget is None:
        return result
    return with_budget(result, budget, safety_margin=budget_margin(planned_from, request))
