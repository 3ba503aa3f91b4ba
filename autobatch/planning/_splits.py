"""PURE: the search for a split of one rank's samples into micro-batches and accumulation steps.

:mod:`autobatch.planning._planner` checks the arguments and resolves the limit, then asks this
module for the steps (:func:`choose_steps`) and, when no split reaches the request, for the
nearest effective batch sizes that can be reached (:func:`nearest_reachable`). The rules are the
planner's (docs/how-it-works.md, "Planner rules"; :mod:`autobatch.planning._planner`'s
docstring). Imports neither torch nor pynvml.

Example::

    constraints = PlanRequest(effective_batch_size=64)
    choose_steps(64, 24, constraints, None)    # (4, ""): 4 micro-batches of 16
    split_sizes(97, 5)                         # (20, 20, 19, 19, 19)
"""

from __future__ import annotations

import math
from collections.abc import Callable

from autobatch.planning._limits import StepTimes
from autobatch.planning._request import MAX_GRADIENT_ACCUMULATION_STEPS, PlanRequest
from autobatch.units import counted

__all__ = [
    "choose_steps",
    "degraded_note",
    "describe_rules",
    "equal_steps",
    "nearest_reachable",
    "split_seconds",
    "split_sizes",
]


def describe_rules(per_rank: int, max_micro_batch_size: int, constraints: PlanRequest) -> str:
    """What a split must meet, in words, for a message about ``per_rank`` samples per rank."""
    text = f"micro-batches of at most {max_micro_batch_size}"
    if constraints.multiple_of > 1:
        text += f" that are multiples of {constraints.multiple_of}"
    steps = constraints.max_steps
    # The user's limit is always named; the internal cap only where it binds.
    if steps < MAX_GRADIENT_ACCUMULATION_STEPS or per_rank > max_micro_batch_size * steps:
        text += f", at most {counted(steps, 'accumulation step')}"
        if constraints.max_gradient_accumulation_steps is None:
            text += " (the planner's own bound, MAX_GRADIENT_ACCUMULATION_STEPS)"
    if not constraints.unequal_allowed:
        text += ", equal sizes"
    return text


def degraded_note(
    per_rank: int, steps: int, max_micro_batch_size: int, constraints: PlanRequest
) -> tuple[str, ...]:
    """A note when the split chosen takes more than twice the accumulation steps ``per_rank``
    samples need in micro-batches of at most ``max_micro_batch_size`` (``ceil(per_rank / M)``,
    the most ``uneven="auto"`` spends on equal sizes): the constraints (equal sizes,
    ``multiple_of``) forced much smaller micro-batches. It names the cause and the ways back to
    the fewest steps: unequal micro-batches where ``uneven="never"`` forbade them, and the
    nearest effective batch sizes that split into the fewest steps.

    Example: 97 samples, at most 24, ``uneven='never'``: 97 steps of 1 where 5 would do.
    """
    fewest = -(-per_rank // max_micro_batch_size)
    if steps <= 2 * fewest:  # uneven="auto" itself takes up to twice the fewest for equal sizes
        return ()
    size = per_rank // steps
    why = (
        "equal micro-batches"
        if constraints.multiple_of == 1
        else (f"micro-batches that are multiples of {constraints.multiple_of}")
    )
    if _is_prime(per_rank) and constraints.multiple_of == 1:
        why += f" ({per_rank} is prime)"
    ways = []
    if constraints.multiple_of == 1 and constraints.uneven == "never":
        ways.append(f"uneven='auto' ({_fewest_split(per_rank, fewest)}, losses weighted by size)")
    nearby = _well_split(per_rank, fewest, max_micro_batch_size, constraints)
    world_size = constraints.world_size
    if nearby:
        ways.append(
            "an effective batch size that splits well: "
            + " or ".join(f"{n * world_size} ({_fewest_split(n, fewest)})" for n in nearby)
        )
    text = (
        f"degraded split: {why} split {per_rank} samples per rank only as {steps} "
        f"accumulation steps of {size}, where {fewest} steps of at most {max_micro_batch_size} "
        "would do"
    )
    return (f"{text}; use {', or '.join(ways)}" if ways else text,)


def _fewest_split(per_rank: int, steps: int) -> str:
    sizes = split_sizes(per_rank, steps)
    if sizes[0] == sizes[-1]:
        return f"{steps} steps of {sizes[0]}"
    return f"{steps} steps of {sizes[0]} and {sizes[-1]}"


def _well_split(
    per_rank: int, steps: int, max_micro_batch_size: int, constraints: PlanRequest
) -> list[int]:
    """The nearest sample counts per rank below and above ``per_rank`` that split into
    ``steps`` equal micro-batches of at most ``max_micro_batch_size`` meeting ``multiple_of``."""
    unit = steps * constraints.multiple_of
    below = per_rank // unit * unit
    above = below + unit
    return [
        n for n in (below, above) if n >= 1 and n != per_rank and n // steps <= max_micro_batch_size
    ]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def split_sizes(per_rank: int, steps: int) -> tuple[int, ...]:
    """``per_rank`` samples in ``steps`` micro-batches differing by at most 1, larger first."""
    smaller, num_larger = divmod(per_rank, steps)
    return (smaller + 1,) * num_larger + (smaller,) * (steps - num_larger)


def split_seconds(per_rank: int, steps: int, step_time: Callable[[int], float]) -> float:
    """Seconds per effective batch on one rank for :func:`split_sizes`'s micro-batches, from
    ``step_time`` (seconds of one training step by micro-batch size)."""
    smaller, num_larger = divmod(per_rank, steps)
    larger_seconds = step_time(smaller + 1) * num_larger if num_larger else 0.0
    return larger_seconds + step_time(smaller) * (steps - num_larger)


def equal_steps(per_rank: int, max_micro_batch_size: int, constraints: PlanRequest) -> list[int]:
    """Accumulation steps of every equal split of micro-batches of at most
    ``max_micro_batch_size`` that meets the constraints, ascending.

    Costs O(min(k range, M, sqrt(per_rank))) divisions, where the k range is at most
    MAX_GRADIENT_ACCUMULATION_STEPS wide.
    """
    limit, step, max_steps = max_micro_batch_size, constraints.multiple_of, constraints.max_steps
    root = math.isqrt(per_rank)
    lowest = -(-per_rank // limit)
    highest = min(per_rank, max_steps)
    if highest - lowest < root:  # fewer step counts than divisor candidates: try each
        return [
            k
            for k in range(lowest, highest + 1)
            if per_rank % k == 0 and (per_rank // k) % step == 0
        ]
    if limit <= root:
        steps = [per_rank // d for d in range(limit // step * step, 0, -step) if per_rank % d == 0]
    else:
        steps = []
        for d in range(1, root + 1):  # each divisor pair (d, q): d steps of q, q steps of d
            if per_rank % d:
                continue
            q = per_rank // d
            if q <= limit and q % step == 0:
                steps.append(d)
            if q != d and d % step == 0:
                steps.append(q)
        steps.sort()
    return [k for k in steps if k <= max_steps]


def choose_steps(
    per_rank: int,
    max_micro_batch_size: int,
    constraints: PlanRequest,
    step_time: StepTimes | None,
) -> tuple[int, str] | None:
    """Accumulation steps for ``per_rank`` samples in micro-batches of at most
    ``max_micro_batch_size`` and a note (may be empty); None if none fit.

    The rule: the fewest steps among the candidates (equal or unequal sizes, see the planner),
    unless step times show another candidate faster beyond doubt: every micro-batch size of
    both splits timed more than once, and the other split's time per effective batch from its
    slowest timings below the fewest steps' from their fastest (:class:`StepTimes`). Among
    such candidates the one with the least predicted time wins (ties: fewer steps). A throughput
    choice notes both times and the timings behind them; so does keeping the fewest steps when
    the predicted times favoured another split the timings could not confirm.
    """
    minimal = -(-per_rank // max_micro_batch_size)
    equal = equal_steps(per_rank, max_micro_batch_size, constraints)
    minimal_ok = constraints.unequal_allowed and minimal <= constraints.max_steps
    if constraints.uneven == "always":
        candidates = [minimal] if minimal_ok else []
    elif not minimal_ok or (equal and equal[0] <= 2 * minimal):
        candidates = equal
    else:
        candidates = [minimal]
    if not candidates:
        return None
    fewest = candidates[0]
    if step_time is None or len(candidates) == 1:
        return fewest, ""
    fewest_seconds = split_seconds(per_rank, fewest, step_time.seconds)
    fewest_range = _split_range(per_rank, fewest, step_time)
    best, best_seconds = fewest, fewest_seconds  # the fastest beyond doubt
    guess, guess_seconds = fewest, fewest_seconds  # the fastest by predicted time alone
    for steps in candidates[1:]:
        seconds = split_seconds(per_rank, steps, step_time.seconds)
        if seconds < guess_seconds * (1 - 1e-9):
            guess, guess_seconds = steps, seconds
        if seconds >= best_seconds * (1 - 1e-9) or fewest_range is None:
            continue
        steps_range = _split_range(per_rank, steps, step_time)
        if steps_range is not None and steps_range[1] < fewest_range[0]:
            best, best_seconds = steps, seconds
    if best != fewest:
        return best, (
            f"chose {best} steps of {per_rank // best} over {fewest} of {per_rank // fewest} by "
            f"step time: {best_seconds:.4g} s vs {fewest_seconds:.4g} s per effective batch, "
            "each timed more than once and apart by more than the timings' spread ("
            + step_time.describe(_sizes(per_rank, best) + _sizes(per_rank, fewest))
            + ")"
        )
    if guess == fewest:
        return fewest, ""
    return fewest, (
        f"kept {fewest} steps of {per_rank // fewest}: step times predict {guess} steps of "
        f"{per_rank // guess} faster ({guess_seconds:.4g} s vs {fewest_seconds:.4g} s per "
        "effective batch), but a split is chosen by throughput only when its sizes were timed "
        "more than once and the difference exceeds the timings' spread ("
        + step_time.describe(_sizes(per_rank, guess) + _sizes(per_rank, fewest))
        + ")"
    )


def _sizes(per_rank: int, steps: int) -> list[int]:
    """The distinct micro-batch sizes of :func:`split_sizes`."""
    smaller, num_larger = divmod(per_rank, steps)
    return [smaller + 1, smaller] if num_larger else [smaller]


def _split_range(per_rank: int, steps: int, step_time: StepTimes) -> tuple[float, float] | None:
    """Seconds per effective batch from the fastest and from the slowest timings of the
    split's sizes; None when one of them was not timed more than once."""
    smaller, num_larger = divmod(per_rank, steps)
    low = high = 0.0
    for size, count in ((smaller + 1, num_larger), (smaller, steps - num_larger)):
        if not count:
            continue
        found = step_time.seconds_range(size)
        if found is None:
            return None
        low, high = low + found[0] * count, high + found[1] * count
    return low, high


def _largest_product_at_most(n: int, a: int, b: int) -> int | None:
    """Largest ``x <= n`` with ``x = i * j``, ``1 <= i <= a``, ``1 <= j <= b``."""
    if n < 1:
        return None
    short, long = min(a, b), max(a, b)
    return max(i * min(long, n // i) for i in range(1, min(short, n) + 1))


def _smallest_product_at_least(n: int, a: int, b: int) -> int | None:
    """Smallest ``x >= n`` with ``x = i * j``, ``1 <= i <= a``, ``1 <= j <= b``."""
    n = max(n, 1)
    if n > a * b:
        return None
    short, long = min(a, b), max(a, b)
    return min(i * -(-n // i) for i in range(1, short + 1) if -(-n // i) <= long)


def nearest_reachable(
    max_micro_batch_size: int, constraints: PlanRequest
) -> tuple[int | None, int | None]:
    """Nearest reachable effective batch sizes strictly below/above the constraints' unreachable
    one, with micro-batches of at most ``max_micro_batch_size``."""
    effective, world_size = constraints.effective_batch_size, constraints.world_size
    below_rank, above_rank = effective // world_size, -(-effective // world_size)
    if effective % world_size == 0:
        below_rank, above_rank = below_rank - 1, above_rank + 1
    limit, step, max_steps = max_micro_batch_size, constraints.multiple_of, constraints.max_steps
    below: int | None
    above: int | None
    if constraints.unequal_allowed:
        # Any per-rank count from 1 to M * K splits into <= K micro-batches of <= M.
        top = min(below_rank, limit * max_steps)
        below = top if top >= 1 else None
        above = above_rank if above_rank <= limit * max_steps else None
    else:
        units = limit // step
        low = _largest_product_at_most(below_rank // step, units, max_steps)
        high = _smallest_product_at_least(-(-above_rank // step), units, max_steps)
        below = None if low is None else low * step
        above = None if high is None else high * step
    return (
        None if below is None else below * world_size,
        None if above is None else above * world_size,
    )
