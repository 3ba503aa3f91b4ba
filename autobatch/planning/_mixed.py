"""PURE: a plan per rank for data-parallel ranks on different cards (an 80 GB beside a 40 GB part).

Each rank ``r`` brings the largest micro-batch its own probe found, ``M_r``, and optionally a
line of its step time, ``seconds_r(m) = fixed_r + per_sample_r * m`` (:class:`StepLine`; a
profile's timed trials give one with :meth:`StepLine.fit`). :func:`split_ranks` gives every
rank the same ``gradient_accumulation_steps`` ``k`` and its own micro-batch ``m_r <= M_r`` (a
multiple of ``multiple_of``, at least one multiple) with ``k * sum(m_r) == effective_batch_size``
exactly, or refuses naming the nearest effective batches that can be met.

The objective. Ranks run their ``k`` micro-steps side by side and meet at the gradient
all-reduce, so an optimizer step takes ``k * max_r seconds_r(m_r)`` (communication aside). With
step lines the plan minimises that over every feasible ``k`` and split (ties within 1e-9: fewer
steps). Without them the fewest feasible ``k`` is used and the split minimises ``max_r m_r /
M_r``, the largest share of its own limit any rank fills: micro-batches in proportion to memory.
Both are one problem: minimise ``max_r v_r(m_r)`` for increasing per-rank values ``v_r`` (the
step line, or ``m / M_r``).

The algorithm for one ``k``. Count in units of ``q = multiple_of``: rank ``r`` takes ``u_r`` units,
``1 <= u_r <= U_r = M_r // q``, and the units sum to ``n = effective_batch_size / (k * q)``.
Starting every rank at one unit, a split is a choice of ``n - W`` increments, rank ``r``'s
``j``-th increment (to ``u_r = j``) costing ``v_r(j * q)``. A rank's increments cost no less the
later they come, so a split is a set of increments closed downwards within each rank, and its
objective is the costliest unit held (every rank's first included). Take the ``n - W`` cheapest
increments in the total order (cost, larger ``M_r`` first, rank, ``j``): they are closed
downwards, so a split, and any other split holds ``n - W`` increments, so one at least as costly
as the ``(n - W)``-th cheapest: optimal. That is the greedy water-filling that tops up the rank
whose next unit is cheapest. It runs fast by starting near its end: the continuous relaxation
(``u_r`` real, linear between its bounds) reaches ``n - W`` at a level ``L`` found by binary
search over its breakpoints (sorted once for every ``k``); every rank takes exactly the units
that cost at most ``L`` (a lower set of the total order, so it contains, or is contained in,
the ``n - W`` cheapest), and a heap adds the next cheapest or removes the costliest, about one
per rank at most, since flooring the relaxation loses less than a unit per rank: ``O(W log W)``.

Choosing ``k``. ``k`` divides ``effective_batch_size`` (``O(sqrt(E))`` to list); each feasible
one has the lower bound ``k * max(max_r v_r(q), L_k)`` (an integer split fills to no lower a
level than the relaxation), so they are solved in order of their bound until the bound passes
the best time: exact, and usually one or two solves. Every cost compares as the same float
expression (:meth:`StepLine.seconds`, or one rounding of ``m / M_r``), so ties are exact ties.

The public entry, which takes each rank's limit and the request, is
:func:`autobatch.planning.plan_mixed_ranks`.

Example::

    plans = split_ranks([48, 20], None, PlanRequest(effective_batch_size=96, world_size=2))
    plans[0].rank_micro_batch_sizes, plans[0].gradient_accumulation_steps    # (34, 14), 2
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

from autobatch.errors import ConfigError, NoFeasiblePlanError, Remedy
from autobatch.planning._limits import require_int
from autobatch.planning._plan import Plan
from autobatch.planning._request import MAX_GRADIENT_ACCUMULATION_STEPS, PlanRequest
from autobatch.units import counted

__all__ = ["StepLine", "split_ranks"]

_TIE = 1e-9
"""Relative difference in time per optimizer step below which two ``k`` tie (fewer wins)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepLine:
    """Seconds of one training step on one rank: ``fixed_seconds + per_sample_seconds * m``."""

    fixed_seconds: float = 0.0
    """Seconds of a step whatever its micro-batch (optimizer step, launches), >= 0."""
    per_sample_seconds: float
    """Seconds each sample of the micro-batch adds, >= 0."""

    def __post_init__(self) -> None:
        for name in ("fixed_seconds", "per_sample_seconds"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ConfigError(f"step line {name} {value!r} must be finite seconds >= 0")

    def seconds(self, micro_batch_size: int) -> float:
        """Seconds of one step at ``micro_batch_size`` samples."""
        return self.fixed_seconds + self.per_sample_seconds * micro_batch_size

    @classmethod
    def fit(cls, step_seconds: Mapping[int, float]) -> StepLine:
        """The least-squares line through measured steps (seconds by micro-batch size, two sizes
        or more; a profile's fitting trials), kept non-negative: a negative slope becomes the
        mean time, a negative intercept the line through the origin.

        Raises:
            ConfigError: fewer than two sizes, a size that is not an int >= 1, or seconds that
                are not finite and >= 0.
        """
        if not isinstance(step_seconds, Mapping) or len(step_seconds) < 2:
            raise ConfigError(
                f"step_seconds {step_seconds!r} must map two micro-batch sizes or more to "
                "seconds, e.g. {8: 0.1, 16: 0.18}"
            )
        for size, value in step_seconds.items():
            require_int("step_seconds micro-batch size", size, 1)
            cls(per_sample_seconds=value)  # checks the seconds
        xs, ys = list(step_seconds), [float(v) for v in step_seconds.values()]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
        if slope <= 0:
            return cls(per_sample_seconds=0.0, fixed_seconds=mean_y)
        if mean_y - slope * mean_x < 0:
            through_origin = sum(x * y for x, y in zip(xs, ys, strict=True))
            return cls(per_sample_seconds=through_origin / sum(x * x for x in xs))
        return cls(fixed_seconds=mean_y - slope * mean_x, per_sample_seconds=slope)


class _Rank:
    """One rank in units of ``step`` samples: its value ``v(u) = fixed + per_sample * (u *
    step) / scale``, seconds with a step line, the share of its max (``scale = M``) without."""

    __slots__ = (
        "fixed",
        "index",
        "max_micro_batch_size",
        "max_units",
        "per_sample",
        "scale",
        "step",
    )

    def __init__(self, index: int, maximum: int, step: int, line: StepLine | None) -> None:
        self.index, self.max_micro_batch_size, self.step = index, maximum, step
        self.max_units = maximum // step
        self.fixed = 0.0 if line is None else float(line.fixed_seconds)
        self.per_sample = 1.0 if line is None else float(line.per_sample_seconds)
        self.scale = float(maximum) if line is None else 1.0

    def value(self, units: int) -> float:
        # With a line, scale 1 makes this StepLine.seconds exactly; without, one rounding of
        # m / M, so equal shares compare equal.
        return self.fixed + self.per_sample * (units * self.step) / self.scale

    def units_within(self, level: float) -> int:
        """The most units (at least 1) whose values are all <= ``level``."""
        top = self.max_units
        if self.per_sample == 0:
            return top if self.fixed <= level else 1
        guess = (level - self.fixed) * self.scale / (self.per_sample * self.step)
        units = top if not guess < top else max(1, int(guess))
        while units < top and self.value(units + 1) <= level:
            units += 1
        while units > 1 and self.value(units) > level:
            units -= 1
        return units


class _Relaxation:
    """The continuous fill: increments taken at level ``L``, ``sum_r clip(u_r(L), 1, U_r) - 1``
    with ``u_r`` real and linear between ``v_r(1)`` and ``v_r(U_r)`` (a step where those meet),
    as breakpoints with the count reached at each and the slope after it."""

    def __init__(self, ranks: Sequence[_Rank]) -> None:
        events: list[tuple[float, float, int]] = []  # (level, change of slope, jump)
        for rank in ranks:
            if rank.max_units < 2:
                continue
            low, high = rank.value(1), rank.value(rank.max_units)
            if high > low:
                slope = (rank.max_units - 1) / (high - low)
                events += [(low, slope, 0), (high, -slope, 0)]
            else:
                events.append((low, 0.0, rank.max_units - 1))
        events.sort()
        self.levels: list[float] = []
        self.counts: list[float] = []
        self.slopes: list[float] = []
        count = slope = 0.0
        for level, change, jump in events:
            if self.levels:
                count += slope * (level - self.levels[-1])
            count, slope = count + jump, slope + change
            if self.levels and self.levels[-1] == level:
                self.counts[-1], self.slopes[-1] = count, slope
            else:
                self.levels.append(level)
                self.counts.append(count)
                self.slopes.append(slope)

    def level(self, need: int) -> float:
        """The lowest level at which the relaxation takes ``need`` (>= 1) increments."""
        i = bisect.bisect_left(self.counts, need)
        if i == 0 or i == len(self.counts):
            return self.levels[min(i, len(self.levels) - 1)]
        start, slope = self.levels[i - 1], self.slopes[i - 1]
        if slope > 0:
            return min(start + (need - self.counts[i - 1]) / slope, self.levels[i])
        return self.levels[i]


def _split(ranks: Sequence[_Rank], need: int, level: float) -> list[int]:
    """Each rank's units: the ``need`` cheapest increments (module docstring), from the units
    within ``level`` (any level gives the same split; a near one needs few heap steps)."""
    units = [rank.units_within(level) for rank in ranks] if need else [1] * len(ranks)
    count = sum(units) - len(units)
    if count < need:  # add the cheapest next units, in the total order
        adds = [_order(r, units[r.index] + 1) for r in ranks if units[r.index] < r.max_units]
        heapq.heapify(adds)
        for _ in range(need - count):
            _, _, index, unit = heapq.heappop(adds)
            units[index] = unit
            if unit < ranks[index].max_units:
                heapq.heappush(adds, _order(ranks[index], unit + 1))
    elif count > need:  # drop the costliest units, in the reverse order
        drops = [_reverse_order(r, units[r.index]) for r in ranks if units[r.index] > 1]
        heapq.heapify(drops)
        for _ in range(count - need):
            index = -heapq.heappop(drops)[2]
            units[index] -= 1
            if units[index] > 1:
                heapq.heappush(drops, _reverse_order(ranks[index], units[index]))
    return units


def _order(rank: _Rank, unit: int) -> tuple[float, int, int, int]:
    """The increment to ``unit`` units in the total order: cost, larger max first, rank, unit."""
    return rank.value(unit), -rank.max_micro_batch_size, rank.index, unit


def _reverse_order(rank: _Rank, unit: int) -> tuple[float, int, int, int]:
    """:func:`_order` reversed, for a heap that pops the costliest increment first."""
    return -rank.value(unit), rank.max_micro_batch_size, -rank.index, -unit


def split_ranks(
    maxima: Sequence[int], lines: Sequence[StepLine] | None, request: PlanRequest
) -> tuple[Plan, ...]:
    """One ``gradient_accumulation_steps`` for every rank and a micro-batch per rank.

    Args:
        maxima: each rank's largest micro-batch, in rank order, ints >= 1 (one per rank of
            ``request.world_size``).
        lines: each rank's step time, in rank order; None plans by memory alone (fewest
            accumulation steps, micro-batches in proportion to the maxima).
        request: the effective batch (met exactly), ``multiple_of`` and
            ``max_gradient_accumulation_steps``, checked by the request.

    Returns:
        One :class:`~autobatch.planning.Plan` per rank, in rank order: the same
        ``gradient_accumulation_steps`` and ``rank_micro_batch_sizes``, its own
        ``micro_batch_size`` and ``max_micro_batch_size``; ``predicted_seconds_per_effective_batch``
        is the job's time per optimizer step (the slowest rank's ``k`` micro-steps), None without
        step lines. A rank with a larger limit gets a micro-batch at least as large (with step
        lines, when its step is also no slower at every size).

    Raises:
        NoFeasiblePlanError: ``multiple_of`` exceeds a rank's maximum, or no ``k`` and split meet
            ``effective_batch_size`` exactly; the message and the remedies name the nearest
            effective batch sizes that can be met, below and above.
    """
    effective_batch_size, multiple_of = request.effective_batch_size, request.multiple_of
    steps = request.max_steps
    for index, maximum in enumerate(maxima):
        if maximum < multiple_of:
            raise NoFeasiblePlanError(
                f"multiple_of {multiple_of} exceeds rank {index}'s max micro-batch size "
                f"{maximum}: no micro-batch size is allowed there; lower multiple_of"
            )
    ranks = [
        _Rank(index, maximum, multiple_of, None if lines is None else lines[index])
        for index, maximum in enumerate(maxima)
    ]
    candidates = _feasible_steps(ranks, effective_batch_size, multiple_of, steps)
    if not candidates:
        raise _refusal(ranks, effective_batch_size, multiple_of, steps)
    relaxation = _Relaxation(ranks)
    if lines is None:
        chosen = candidates[0]
        units = _solve(ranks, relaxation, effective_batch_size // (chosen * multiple_of))
    else:
        chosen, units = _fastest(ranks, relaxation, effective_batch_size, multiple_of, candidates)
    sizes = tuple(unit * multiple_of for unit in units)
    return _plans(ranks, sizes, chosen, effective_batch_size, timed=lines is not None)


def _feasible_steps(ranks: Sequence[_Rank], effective: int, step: int, max_steps: int) -> list[int]:
    """Every ``k <= max_steps`` that some split meets: ``k`` divides ``effective`` into ``n``
    units of ``step`` samples, with one unit per rank at least and ``U_r`` at most; ascending."""
    total = sum(rank.max_units for rank in ranks)
    found = []
    for low in range(1, math.isqrt(effective) + 1):
        if effective % low == 0:
            found += [low, effective // low] if low * low != effective else [low]
    return sorted(
        k
        for k in found
        if k <= max_steps
        and (effective // k) % step == 0
        and len(ranks) <= effective // k // step <= total
    )


def _solve(ranks: Sequence[_Rank], relaxation: _Relaxation, num_units: int) -> list[int]:
    """The optimal split of ``num_units`` units over the ranks (module docstring)."""
    need = num_units - len(ranks)
    return _split(ranks, need, relaxation.level(need) if need else 0.0)


def _fastest(
    ranks: Sequence[_Rank],
    relaxation: _Relaxation,
    effective: int,
    step: int,
    candidates: Sequence[int],
) -> tuple[int, list[int]]:
    """The ``k`` and split with the least time per optimizer step, ``k * max_r v_r``; ``k`` in
    order of the lower bound ``k * max(max_r v_r(1), L_k)`` until it passes the best time."""
    floor = max(rank.value(1) for rank in ranks)
    bounds = []
    for k in candidates:
        need = effective // (k * step) - len(ranks)
        bounds.append((k * max(floor, relaxation.level(need) if need else 0.0), k))
    bounds.sort()
    best: tuple[float, int, list[int]] | None = None
    for bound, k in bounds:
        if best is not None and bound > best[0] * (1 + _TIE):
            break
        units = _solve(ranks, relaxation, effective // (k * step))
        seconds = k * max(rank.value(unit) for rank, unit in zip(ranks, units, strict=True))
        if (
            best is None
            or seconds < best[0] * (1 - _TIE)
            or (seconds <= best[0] * (1 + _TIE) and k < best[1])
        ):
            best = (seconds, k, units)
    assert best is not None, "a feasible k has a split"
    return best[1], best[2]


def _refusal(
    ranks: Sequence[_Rank], effective: int, step: int, max_steps: int
) -> NoFeasiblePlanError:
    """The error for an effective batch no ``k`` and split meet, naming the nearest that can be
    met: ``step * k * n`` with ``1 <= k <= max_steps`` and ``W <= n <= sum U_r`` units."""
    world, total = len(ranks), sum(rank.max_units for rank in ranks)
    below = _largest_product_at_most((effective - 1) // step, max_steps, world, total)
    above = _smallest_product_above(effective // step, max_steps, world, total)
    together = sum(rank.max_micro_batch_size for rank in ranks)
    rules = f"micro-batches of at most each rank's max (together {together})"
    if step > 1:
        rules += f" that are multiples of {step}"
    if max_steps < MAX_GRADIENT_ACCUMULATION_STEPS:
        rules += f", at most {counted(max_steps, 'accumulation step')}"
    nearest = tuple(step * v for v in (below, above) if v is not None)
    use = [Remedy(parameter="effective_batch_size", values=nearest)] if nearest else []
    return NoFeasiblePlanError(
        f"no mixed plan reaches effective_batch_size {effective} on {world} ranks with {rules}: "
        "it must be gradient_accumulation_steps (one for every rank) times the sum of the "
        "ranks' micro-batches; nearest reachable effective_batch_size: "
        f"{'none' if below is None else step * below} below, "
        f"{'none' if above is None else step * above} above",
        remedies=(*use, Remedy(purpose="looser constraints")),
    )


def _largest_product_at_most(limit: int, max_k: int, low_n: int, high_n: int) -> int | None:
    """Largest ``k * n <= limit`` with ``1 <= k <= max_k`` and ``low_n <= n <= high_n``.

    The best pair has ``k`` or ``n`` at most ``sqrt(limit)``: for each such ``k`` the largest
    ``n``, for each such ``n`` the largest ``k``, so ``O(sqrt(limit))``."""
    root, best = math.isqrt(max(limit, 0)), 0
    for k in range(1, min(max_k, root) + 1):
        n = min(high_n, limit // k)
        if n >= low_n:
            best = max(best, k * n)
    for n in range(low_n, min(high_n, root) + 1):
        best = max(best, n * min(max_k, limit // n))
    return best or None


def _smallest_product_above(limit: int, max_k: int, low_n: int, high_n: int) -> int | None:
    """Smallest ``k * n > limit`` with ``1 <= k <= max_k`` and ``low_n <= n <= high_n``.

    ``k`` starts at the least that can pass ``limit``; the best pair has ``k`` or ``n`` at most
    the square root of the best product found so far, which bounds both loops."""
    target = limit + 1
    k = max(1, -(-target // high_n))
    best: int | None = None
    while k <= max_k and (best is None or k * k <= best):
        product = k * max(low_n, -(-target // k))
        best = product if best is None else min(best, product)
        k += 1
    n = low_n
    while best is not None and n <= high_n and n * n <= best:
        k = max(1, -(-target // n))
        if k <= max_k:
            best = min(best, k * n)
        n += 1
    return best


def _plans(
    ranks: Sequence[_Rank], sizes: tuple[int, ...], steps: int, effective: int, *, timed: bool
) -> tuple[Plan, ...]:
    """One plan per rank for the rank micro-batches ``sizes`` and ``steps`` accumulation steps,
    with the notes they share (the formula, the loss weights, the slowest rank)."""
    world = len(ranks)
    values = [rank.value(size // rank.step) for rank, size in zip(ranks, sizes, strict=True)]
    notes = []
    if len(set(sizes)) > 1:
        notes.append(
            f"ranks train micro-batches of different sizes: weight each micro-batch's mean loss "
            f"by world_size x micro_batch_size / effective_batch_size ({world} x "
            f"micro_batch_size / {effective}), not 1 / {steps}, so the gradient averaged over "
            "ranks equals the full batch's"
        )
    seconds = None
    if timed:
        slowest = max(range(world), key=values.__getitem__)
        seconds = steps * values[slowest]
        notes.append(
            f"{seconds:.4g} s per optimizer step: {steps} micro-steps of the slowest rank, "
            f"{slowest} ({values[slowest]:.4g} s each at micro-batch {sizes[slowest]})"
        )
    else:
        notes.append(
            "no step times: the fewest accumulation steps, micro-batches in proportion to each "
            "rank's max (the largest share of its max any rank fills is the least)"
        )
    first = _rank_plan(ranks[0], sizes, steps, effective, seconds, ())
    shared = (*notes, first.formula()) if world > 1 else tuple(notes)
    return tuple(_rank_plan(rank, sizes, steps, effective, seconds, shared) for rank in ranks)


def _rank_plan(
    rank: _Rank,
    sizes: tuple[int, ...],
    steps: int,
    effective: int,
    seconds: float | None,
    notes: tuple[str, ...],
) -> Plan:
    """``rank``'s plan: its micro-batch, ``steps`` times, beside every rank's."""
    size = sizes[rank.index]
    return Plan(
        micro_batch_size=size,
        gradient_accumulation_steps=steps,
        world_size=len(sizes),
        effective_batch_size=effective,
        requested_effective_batch_size=effective,
        micro_batch_sizes=(size,) * steps,
        rank_micro_batch_sizes=sizes,
        exact=True,
        max_micro_batch_size=rank.max_micro_batch_size,
        predicted_seconds_per_effective_batch=seconds,
        notes=notes,
    )
