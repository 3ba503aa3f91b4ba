"""Split an effective batch into micro-batches and accumulation steps: numbers in, Plan out.

PURE: imports neither torch nor pynvml, so schedulers and the service can plan on machines
without a GPU, a driver, or torch.

Rules (docs/how-it-works.md, "Planner rules"), with ``E = effective_batch_size``,
``W = world_size``, ``P = E / W`` samples per rank, ``M`` the largest micro-batch that may run,
``k`` accumulation steps and ``m`` the micro-batch size:

- ``E`` must be a positive multiple of ``W``.
- Fewest ``k`` first, then the largest ``m <= M`` with ``m * k * W == E``.
- Micro-batches of unequal size (differing by 1, larger first) are used when equal ones would
  need many more steps. ``uneven="auto"`` (the default) uses equal sizes when some equal split
  meets every constraint with ``k <= 2 * ceil(P / M)``; otherwise (``P`` prime, say) it uses the
  minimal ``k = ceil(P / M)`` with unequal sizes. ``"never"`` only plans equal sizes, ``"always"``
  always uses the minimal ``k``. Unequal sizes need each micro-batch's loss weighted by its share
  of the ``P`` samples (not ``1 / k``) for the gradient to equal the full batch's.
- With step times, another split than the fewest steps wins only by a difference measured more
  than once and beyond the timings' spread (:func:`~autobatch.planning._splits.choose_steps`);
  given ``step_seconds`` are taken as exact. The notes show the timings behind the choice.

The entries that take a request and a limit are :mod:`autobatch.planning._entries`'s.

Example::

    >>> limit = resolve_plan_limit(24, PlanRequest(effective_batch_size=64), None)
    >>> p = plan_within(limit, PlanRequest(effective_batch_size=64), 24)
    >>> p.micro_batch_size, p.gradient_accumulation_steps
    (16, 4)
"""

from __future__ import annotations

import dataclasses

from autobatch.errors import (
    ConfigError,
    NoFeasiblePlanError,
    Remedy,
)
from autobatch.planning._limits import Limit, PlanSource, resolve_limit
from autobatch.planning._plan import Plan, WorldSizeOption, formula_note
from autobatch.planning._request import PlanRequest
from autobatch.planning._splits import (
    choose_steps,
    degraded_note,
    describe_rules,
    nearest_reachable,
    split_seconds,
    split_sizes,
)
from autobatch.profile import MemoryModel, Profile

__all__ = [
    "largest_useful_micro_batch_size",
    "plan_within",
    "resolve_plan_limit",
    "table_within",
]


def largest_useful_micro_batch_size(effective_batch_size: int, world_size: int) -> int:
    """``ceil(effective_batch_size / world_size)``: no plan for that request uses a larger
    micro-batch (the nearest reachable effective batch size included), so no probe for it needs
    to try one. Both arguments are positive ints (checked by :class:`PlanRequest`)."""
    return -(-effective_batch_size // world_size)


def plan_within(
    limit: Limit, request: PlanRequest, planned_from: int | Profile | MemoryModel
) -> Plan:
    """The plan for ``request`` within a resolved ``limit``, with the gradient-sync and
    activation checkpointing modes of the profile it was ``planned_from``, if any.

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`~autobatch.planning.plan_request`.
    """
    return _measured_in(_plan(limit, request), planned_from)


def _measured_in(result: Plan, limit: int | Profile | MemoryModel) -> Plan:
    """``result`` with the gradient-sync mode and the activation checkpointing mode of the
    profile it was planned from, if any."""
    if not isinstance(limit, Profile):
        return result
    return dataclasses.replace(
        result,
        gradient_sync=limit.gradient_sync,
        activation_checkpointing=limit.activation_checkpointing,
    )


def resolve_plan_limit(
    limit: int | Profile | MemoryModel, request: PlanRequest, source: PlanSource | None
) -> Limit:
    """The limit a plan for ``request`` is made within
    (:func:`~autobatch.planning._limits.resolve_limit`). A profile whose search a failure other
    than memory bounded says so in every plan.

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`~autobatch.planning.plan_request`.
    """
    resolved = resolve_limit(
        limit,
        capacity_bytes=request.capacity_bytes,
        safety_margin=request.safety_margin,
        step_seconds=request.step_seconds,
        source=source,
    )
    if not isinstance(limit, Profile):
        return resolved
    resolved.conditions = limit.conditions
    if not limit.failure_note:
        return resolved
    return dataclasses.replace(resolved, notes=(limit.failure_note, *resolved.notes))


def table_within(
    limit: Limit, request: PlanRequest, planned_from: int | Profile | MemoryModel
) -> list[WorldSizeOption]:
    """One row per ``request.world_sizes`` within a resolved limit (none without them): a world
    size the request cannot reach (fewer samples than ranks, not a multiple of it, no split) is
    its row, with the reason."""
    rows = []
    for world_size in request.world_sizes or ():
        try:
            row = dataclasses.replace(request, world_size=world_size, world_sizes=None)
            result = plan_within(limit, row, planned_from)
        except (ConfigError, NoFeasiblePlanError) as exc:
            rows.append(
                WorldSizeOption(
                    world_size=world_size, plan=None, reason=exc.message, remedies=exc.remedies
                )
            )
        else:
            rows.append(WorldSizeOption(world_size=world_size, plan=result))
    return rows


def _plan(limit: Limit, constraints: PlanRequest) -> Plan:
    effective, world_size = constraints.effective_batch_size, constraints.world_size
    largest = limit.max_micro_batch_size
    if constraints.multiple_of > largest:
        raise NoFeasiblePlanError(
            f"multiple_of {constraints.multiple_of} exceeds the max micro-batch size "
            f"{largest}: no micro-batch size is allowed; lower multiple_of"
        )
    notes = list(limit.notes)
    target = effective
    chosen = None
    if effective % world_size == 0:
        chosen = choose_steps(effective // world_size, largest, constraints, limit.step_time)
    if chosen is None:
        below, above = nearest_reachable(largest, constraints)
        nearest = tuple(v for v in (below, above) if v is not None)
        inexact = Remedy(parameter="allow_inexact", values=(True,), purpose="plan the nearest")
        if effective % world_size:
            cause = f"effective_batch_size {effective} is not a multiple of world_size {world_size}"
        else:
            cause = (
                f"no plan reaches effective_batch_size {effective} on world_size {world_size} "
                f"with {describe_rules(effective // world_size, largest, constraints)}"
            )
        use = [Remedy(parameter="effective_batch_size", values=nearest)] if nearest else []
        if not constraints.allow_inexact and effective % world_size:
            raise ConfigError(cause, remedies=[*use, inexact])
        if not constraints.allow_inexact:
            raise NoFeasiblePlanError(
                f"{cause}; nearest reachable effective_batch_size: "
                f"{below if below is not None else 'none'} below, "
                f"{above if above is not None else 'none'} above",
                remedies=(*use, inexact, Remedy(purpose="looser constraints")),
            )
        target = min(nearest, key=lambda v: abs(v - effective))
        chosen = choose_steps(target // world_size, largest, constraints, limit.step_time)
        assert chosen is not None, "a reachable effective batch size must have a plan"
        notes.append(f"{cause}; planned the nearest, {target}")
    steps, note = chosen
    if note:
        notes.append(note)
    per_rank = target // world_size
    notes.extend(degraded_note(per_rank, steps, largest, constraints))
    sizes = split_sizes(per_rank, steps)
    if sizes[0] != sizes[-1]:
        num_larger = per_rank % steps
        notes.append(
            f"unequal micro-batches ({num_larger} of {sizes[0]}, {steps - num_larger} of "
            f"{sizes[-1]}): weight each micro-batch's loss by its size / {per_rank}, not "
            f"1 / {steps}, so the gradient equals the full batch's"
        )
    if world_size > 1:
        notes.append(formula_note(sizes, target, world_size))
    peak = limit.peak_bytes(sizes[0])
    return Plan(
        micro_batch_size=sizes[0],
        gradient_accumulation_steps=steps,
        world_size=world_size,
        effective_batch_size=target,
        requested_effective_batch_size=effective,
        micro_batch_sizes=sizes,
        exact=target == effective,
        max_micro_batch_size=largest,
        predicted_peak_memory_bytes=peak,
        capacity_bytes=limit.capacity_bytes,
        headroom_bytes=(
            None if peak is None or limit.capacity_bytes is None else limit.capacity_bytes - peak
        ),
        predicted_seconds_per_effective_batch=(
            None
            if limit.step_time is None
            else split_seconds(per_rank, steps, limit.step_time.seconds)
        ),
        source=limit.source,
        prediction=limit.prediction,
        notes=tuple(notes),
        conditions=limit.conditions,
    )
