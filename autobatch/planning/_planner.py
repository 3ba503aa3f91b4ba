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

Example::

    >>> p = plan(24, effective_batch_size=64)
    >>> p.micro_batch_size, p.gradient_accumulation_steps
    (16, 4)
    >>> plan(24, effective_batch_size=97).micro_batch_sizes
    (20, 20, 19, 19, 19)

    # What a probed model would get on 8 cards with 80 GiB each:
    plan(profile, effective_batch_size=512, world_size=8, capacity_bytes=80 * 2**30)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autobatch.errors import (
    ConfigError,
    NoFeasiblePlanError,
    Remedy,
)
from autobatch.planning._limits import (
    DEFAULT_SAFETY_MARGIN,
    Limit,
    PlanSource,
    resolve_limit,
)
from autobatch.planning._plan import Plan, WorldSizeOption, formula_note
from autobatch.planning._request import MAX_GRADIENT_ACCUMULATION_STEPS, PlanRequest, Uneven
from autobatch.planning._splits import (
    choose_steps,
    describe_rules,
    nearest_reachable,
    split_seconds,
    split_sizes,
)
from autobatch.profile import MemoryModel, Profile

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "MAX_GRADIENT_ACCUMULATION_STEPS",
    "Plan",
    "PlanSource",
    "Uneven",
    "WorldSizeOption",
    "largest_useful_micro_batch_size",
    "plan",
    "plan_request",
    "plan_table",
    "plan_world_sizes",
    "resolve_plan_limit",
]


def largest_useful_micro_batch_size(effective_batch_size: int, world_size: int) -> int:
    """``ceil(effective_batch_size / world_size)``: no plan for that request uses a larger
    micro-batch (the nearest reachable effective batch size included), so no probe for it needs
    to try one. Both arguments are positive ints (checked by :func:`plan`)."""
    return -(-effective_batch_size // world_size)


def plan(
    limit: int | Profile | MemoryModel,
    *,
    effective_batch_size: int,
    world_size: int = 1,
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    uneven: Uneven = "auto",
    allow_inexact: bool = False,
    safety_margin: float | None = None,
    capacity_bytes: int | None = None,
    step_seconds: Mapping[int, float] | None = None,
    source: PlanSource | None = None,
) -> Plan:
    """Plan micro-batches and accumulation steps that reach ``effective_batch_size``.

    Args:
        limit: the largest micro-batch that may run per device (an int >= 1); a
            :class:`~autobatch.profile.Profile`, whose ``recommended_micro_batch_size`` is used
            (or, with ``capacity_bytes``, the largest size its measured peaks put under that
            capacity: read off the peaks within the measured sizes, predicted past them); or a
            :class:`~autobatch.profile.MemoryModel` (a peak-bytes line) with ``capacity_bytes``.
        effective_batch_size: samples per optimizer step over all ranks, a positive multiple of
            ``world_size``.
        world_size: data-parallel ranks, >= 1.
        multiple_of: every micro-batch size must be a multiple of this (e.g. 8 for tensor
            cores); > 1 rules out unequal sizes.
        max_gradient_accumulation_steps: upper bound on accumulation steps; None for no bound.
        uneven: ``"auto"``, ``"never"`` or ``"always"``; see the module docstring for the rule.
        allow_inexact: when no plan reaches ``effective_batch_size`` exactly, return the plan for
            the nearest reachable one (ties go below) with ``exact=False``, instead of raising.
        safety_margin: fraction of capacity kept free (0 <= x < 1), profile or memory model
            only; default the profile's own (``DEFAULT_SAFETY_MARGIN`` for a memory model).
        capacity_bytes: plan for a device with this many usable bytes (e.g. an 80 GiB card),
            profile (needs peaks at two sizes, or its memory model) or memory model (required).
        step_seconds: measured seconds per training step by micro-batch size (two sizes or more);
            by default the profile's fitting trials with a time, when the plan is for the device
            they ran on.
        source: where ``limit`` came from, said by the caller that knows: ``"measured"`` (a
            probe just run), ``"cached"`` (a profile read from a store), ``"estimated"`` or
            ``"given"``. Default: ``"estimated"`` for an estimate's profile, ``"measured"`` for
            another profile, ``"given"`` for a number or a memory model. The planner alone
            turns it into ``"predicted"`` when a profile's limit lies outside its measured
            sizes (an estimate's stays ``"estimated"``, with the prediction attached).

    Returns:
        The :class:`Plan`.

    Raises:
        ConfigError: an argument is invalid (named with its value): ``effective_batch_size`` not
            a positive multiple of ``world_size`` (the message names the nearest reachable values),
            a bool where an int belongs, ``uneven="always"`` with ``multiple_of > 1``, a
            ``source`` that is unknown, ``"predicted"`` or ``"measured"``/``"cached"`` for an
            estimate; or a profile that cannot predict for ``capacity_bytes``: peaks that do not
            grow with the micro-batch, are not on a line, or were measured at fewer than two
            sizes without a memory model (probe on that card).
        NoFeasiblePlanError: no split meets every constraint (the message names the nearest
            reachable effective batch sizes below and above), or the model does not fit at
            micro-batch 1 in ``capacity_bytes``.
    """
    fields = {
        "effective_batch_size": effective_batch_size,
        "world_size": world_size,
        "multiple_of": multiple_of,
        "max_gradient_accumulation_steps": max_gradient_accumulation_steps,
        "uneven": uneven,
        "allow_inexact": allow_inexact,
        "safety_margin": safety_margin,
        "capacity_bytes": capacity_bytes,
        "step_seconds": step_seconds,
    }
    return plan_request(limit, _request_in_order(limit, fields, source), source=source)


def plan_request(
    limit: int | Profile | MemoryModel, request: PlanRequest, *, source: PlanSource | None = None
) -> Plan:
    """The plan for ``request`` within ``limit``: what :func:`plan` returns, for a caller holding
    a checked :class:`PlanRequest` (the CLI, the service, the tuning road). ``world_sizes`` is
    not planned here (:func:`plan_table`).

    Args:
        limit: as for :func:`plan`.
        request: the effective batch, world size, options and what to plan for.
        source: as for :func:`plan`.

    Raises:
        ConfigError: the limit or ``source`` is invalid, the limit does not take
            ``capacity_bytes`` or ``safety_margin``, or no plan reaches the effective batch size
            for a reason an argument can fix (as for :func:`plan`).
        NoFeasiblePlanError: as for :func:`plan`.
    """
    return _measured_in(_plan(resolve_plan_limit(limit, request, source), request), limit)


def plan_table(
    limit: int | Profile | MemoryModel, request: PlanRequest, *, source: PlanSource | None = None
) -> list[WorldSizeOption]:
    """One :class:`WorldSizeOption` per world size of ``request.world_sizes`` (none without
    them): what :func:`plan_world_sizes` returns, for a caller holding a checked request.
    ``request.world_size`` is not used.

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`plan_world_sizes`.
    """
    return _table_within(resolve_plan_limit(limit, request, source), request, limit)


def _measured_in(result: Plan, limit: int | Profile | MemoryModel) -> Plan:
    """``result`` with the gradient-sync mode of the profile it was planned from, if any."""
    if not isinstance(limit, Profile):
        return result
    return dataclasses.replace(result, gradient_sync=limit.gradient_sync)


def _request_in_order(
    limit: int | Profile | MemoryModel, fields: Mapping[str, Any], source: PlanSource | None
) -> PlanRequest:
    """The :class:`PlanRequest` of ``fields``; when refused, the error in the planner's order:
    the options and what resolves the limit first, then the limit itself, then the batch sizes
    and world sizes. So a request wrong in its limit and in ``effective_batch_size`` or
    ``world_size`` is told of the limit first; only this error path checks twice."""
    try:
        return PlanRequest(**fields)
    except ConfigError as refused:
        # The same request with batch sizes that always pass: raises if the refusal came first.
        fine = PlanRequest(
            **{**fields, "effective_batch_size": 1, "world_size": 1, "world_sizes": None}
        )
        resolve_limit(
            limit,
            capacity_bytes=fine.capacity_bytes,
            safety_margin=fine.safety_margin,
            step_seconds=fine.step_seconds,
            source=source,
        )
        raise refused from None


def resolve_plan_limit(
    limit: int | Profile | MemoryModel, request: PlanRequest, source: PlanSource | None
) -> Limit:
    """The limit :func:`plan_request` and :func:`plan_table` plan within
    (:func:`~autobatch.planning._limits.resolve_limit`). A profile whose search a failure other
    than memory bounded says so in every plan."""
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


def plan_world_sizes(
    limit: int | Profile | MemoryModel,
    *,
    effective_batch_size: int,
    world_sizes: Sequence[int],
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    uneven: Uneven = "auto",
    allow_inexact: bool = False,
    safety_margin: float | None = None,
    capacity_bytes: int | None = None,
    step_seconds: Mapping[int, float] | None = None,
    source: PlanSource | None = None,
) -> list[WorldSizeOption]:
    """Plan ``effective_batch_size`` at each of ``world_sizes``, for a scheduler choosing N GPUs.

    Args:
        limit: as for :func:`plan`.
        effective_batch_size: as for :func:`plan`.
        world_sizes: candidate numbers of ranks, e.g. ``[1, 2, 4, 8]``; rows keep this order.
        multiple_of, max_gradient_accumulation_steps, uneven, allow_inexact, safety_margin,
            capacity_bytes, step_seconds, source: as for :func:`plan`.

    Returns:
        One :class:`WorldSizeOption` per world size: the plan, or the reason it is infeasible
        there (``effective_batch_size`` not a multiple of it, or no split meets the constraints).

    Raises:
        ConfigError: an argument that does not depend on the world size is invalid, or a world
            size is not an int >= 1.
        NoFeasiblePlanError: the model does not fit at micro-batch 1 in ``capacity_bytes`` (no
            world size helps).
    """
    fields = {
        # One world size stands in for the rows': the checks that involve it come per row.
        "effective_batch_size": effective_batch_size,
        "world_size": 1,
        "world_sizes": world_sizes,
        "multiple_of": multiple_of,
        "max_gradient_accumulation_steps": max_gradient_accumulation_steps,
        "uneven": uneven,
        "allow_inexact": allow_inexact,
        "safety_margin": safety_margin,
        "capacity_bytes": capacity_bytes,
        "step_seconds": step_seconds,
    }
    return plan_table(limit, _request_in_order(limit, fields, source), source=source)


def _table_within(
    limit: Limit, request: PlanRequest, planned_from: int | Profile | MemoryModel
) -> list[WorldSizeOption]:
    """:func:`plan_table`'s rows within a resolved limit: a request a world size cannot reach
    (fewer samples than ranks, not a multiple of it, no split) is its row."""
    rows = []
    for world_size in request.world_sizes or ():
        try:
            row = dataclasses.replace(request, world_size=world_size, world_sizes=None)
            result = _measured_in(_plan(limit, row), planned_from)
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
        if not constraints.allow_inexact and effective % world_size:
            use = [Remedy(parameter="effective_batch_size", values=nearest)] if nearest else []
            raise ConfigError(cause, remedies=[*use, inexact])
        if not constraints.allow_inexact:
            raise NoFeasiblePlanError(
                f"{cause}; nearest reachable effective_batch_size: "
                f"{below if below is not None else 'none'} below, "
                f"{above if above is not None else 'none'} above",
                remedies=(inexact, Remedy(purpose="looser constraints")),
            )
        target = min(nearest, key=lambda v: abs(v - effective))
        chosen = choose_steps(target // world_size, largest, constraints, limit.step_time)
        assert chosen is not None, "a reachable effective batch size must have a plan"
        notes.append(f"{cause}; planned the nearest, {target}")
    steps, note = chosen
    if note:
        notes.append(note)
    per_rank = target // world_size
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
