"""PURE: a mixed plan (:func:`~autobatch.planning.plan_mixed_ranks`) from each rank's resolved
limit, and each rank's plan completed with what its own limit knows.

The ranks of a job on mixed cards each resolve their own limit (a profile measured on their own
card, or one predicted for it: :func:`~autobatch.planning._limits.resolve_limit`). What the plan
needs of every rank is small and plain (:class:`RankLimit`: its largest micro-batch and its step
line), so ranks can share it (``autotune(mixed_ranks=True)`` all-gathers it, the service builds
one per card); each rank's plan then gets its own peak bytes, capacity, source and prediction
back from its own limit (:func:`with_limit`).

Example::

    limits = [resolve_limit(p, capacity_bytes=None, safety_margin=None, step_seconds=None,
                            source="cached") for p in (profile_80gb, profile_40gb)]
    plans = mixed_plans([RankLimit.of(limit) for limit in limits], request)
    with_limit(plans[1], limits[1]).predicted_peak_memory_bytes
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autobatch.errors import ConfigError
from autobatch.planning._limits import Limit, require_int
from autobatch.planning._mixed import StepLine, plan_mixed_ranks
from autobatch.planning._plan import Plan
from autobatch.planning._request import PlanRequest
from autobatch.profile import Profile

__all__ = ["RankLimit", "check_mixed_request", "mixed_plans", "with_limit"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankLimit:
    """What a mixed plan needs of one rank: plain numbers, picklable, to share between ranks."""

    max_micro_batch_size: int
    """The largest micro-batch this rank may run (its own limit), >= 1."""
    step_line: StepLine | None = None
    """This rank's step time by micro-batch size; None without two sizes timed."""

    def __post_init__(self) -> None:
        require_int("max_micro_batch_size", self.max_micro_batch_size, 1)

    @classmethod
    def of(cls, limit: Limit) -> RankLimit:
        """A resolved limit's max and its step line: :meth:`StepLine.fit` through the mean
        timing of each size its profile's fitting trials timed (the warm-up left out, as
        :attr:`~autobatch.planning._limits.Limit.step_time` holds them); no line for a limit
        with fewer than two sizes timed, or with step times given rather than measured."""
        timings = None if limit.step_time is None else limit.step_time.timings
        line = None
        if timings is not None and len(timings) >= 2:
            line = StepLine.fit({size: sum(t) / len(t) for size, t in timings.items()})
        return cls(max_micro_batch_size=limit.max_micro_batch_size, step_line=line)


def check_mixed_request(request: PlanRequest) -> None:
    """Refuse what a mixed plan does not do, by name: an inexact effective batch, a table of
    world sizes, or step times given for one card.

    Raises:
        ConfigError: names the option and the fix.
    """
    refused = (
        (
            "allow_inexact",
            request.allow_inexact,
            "it meets the effective batch exactly or names the nearest reachable ones",
        ),
        ("world_sizes", request.world_sizes is not None, "its world size is its ranks'"),
        (
            "step_seconds",
            request.step_seconds is not None,
            "each rank's step times are its own profile's",
        ),
    )
    for name, given, why in refused:
        if given:
            raise ConfigError(
                f"{name} does not go with a mixed plan (a micro-batch per rank): {why}; leave "
                f"{name} unset"
            )


def mixed_plans(ranks: Sequence[RankLimit], request: PlanRequest) -> tuple[Plan, ...]:
    """One plan per rank (:func:`~autobatch.planning.plan_mixed_ranks`) for ``request``'s
    effective batch, ``multiple_of`` and ``max_gradient_accumulation_steps``; planned by time
    when every rank has a step line, else by memory alone.

    Raises:
        ConfigError: ``request`` asks for what a mixed plan does not do
            (:func:`check_mixed_request`), or its ``world_size`` is not ``len(ranks)``.
        NoFeasiblePlanError: as for :func:`~autobatch.planning.plan_mixed_ranks`.
    """
    check_mixed_request(request)
    if request.world_size != len(ranks):
        raise ConfigError(
            f"world_size {request.world_size} is not the number of ranks planned, {len(ranks)}; "
            "give one limit per data-parallel rank"
        )
    lines = [rank.step_line for rank in ranks]
    return plan_mixed_ranks(
        [rank.max_micro_batch_size for rank in ranks],
        effective_batch_size=request.effective_batch_size,
        step_lines=None if None in lines else lines,  # type: ignore[arg-type]
        multiple_of=request.multiple_of,
        max_gradient_accumulation_steps=request.max_gradient_accumulation_steps,
    )


def with_limit(plan: Plan, limit: Limit, *, profile: Profile | None = None) -> Plan:
    """``plan`` (one rank's, from :func:`mixed_plans`) with what ``limit`` (that rank's own)
    says of it: the predicted peak bytes at its micro-batch, the capacity and headroom, the
    source (``predicted`` with its prediction, when the limit is one), the conditions, the
    limit's notes first, and the gradient-sync mode of ``profile`` (the limit's, if any)."""
    peak = limit.peak_bytes(plan.micro_batch_size)
    capacity = limit.capacity_bytes
    return dataclasses.replace(
        plan,
        predicted_peak_memory_bytes=peak,
        capacity_bytes=capacity,
        headroom_bytes=None if peak is None or capacity is None else capacity - peak,
        source=limit.source,
        prediction=limit.prediction,
        conditions=limit.conditions,
        notes=(*limit.notes, *plan.notes),
        gradient_sync=plan.gradient_sync if profile is None else profile.gradient_sync,
    )
