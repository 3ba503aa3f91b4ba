"""PURE: which micro-batch size to try next, from the outcomes so far.

The probe (real trials) and the estimator (fake trials) share this search. It keeps the bracket
``lo`` (largest size that fitted) .. ``hi`` (smallest that did not: ran out of memory, finished
over the capacity, or failed for another reason) and proposes a *guided* size:

1. the largest size a linear memory model predicts under the capacity, clamped into the bracket
   (one above it when a fit there would leave no spare trial: a failure one above agrees with
   the model and caps the bracket, and the predicted size comes next). The model is a line
   through the two most recent measured peaks (a secant step: peak memory is linear in the
   micro-batch where activations dominate, DESIGN.md), or the line from the prior's fixed bytes
   through the largest fitting size (the prior's slope when that is not above them), or the
   prior alone (:func:`fit_memory_model`; the lines are fitted in
   :mod:`autobatch.planning._lines` and re-exported here);
2. without any model (no prior, fewer than two different peaks), growth: 4x the largest fitting
   size (1 before any trial). A line through tiny sizes, where the optimizer step dominates,
   may overshoot; the failure then caps the bracket and the contradicted line is not trusted
   (below).

A guided size is only a proposal. It is taken while it is *safe* (in the spirit of Brent's
safeguards, on integers), otherwise the search bisects the bracket:

- **the budget**: ``ceil(log2(limit)) + 3`` trials besides the warm-up step that creates the
  optimizer state (:func:`trial_budget`). A guided size is moved (towards the middle of the
  bracket) until, whatever its outcome, bisection could still finish within the budget; so for
  any failure pattern that is monotone in the size, the search ends at the exact max within the
  budget, whatever the peaks say (a model trusted blindly once crept 20000, 19999, 19998, ...
  down to a threshold the peaks did not predict). Counting every real step the probe runs (one
  warm-up, and the chosen size's second step), the worst case is ``ceil(log2(limit)) + 5``.
  Two fewer would leave one spare trial, and then no search has fewer failures than doubling
  on log-uniform thresholds, even from scratch (``bench/search_bounds.py``'s bounds), while the
  estimate's 4-step road (the predicted size, one above it, the second step) needs one more,
  and the road without an estimate (4, then 16, where two peaks give a line) one more again;
- **the model must not be contradicted**: a model that predicts the failed ``hi`` fits (the failure
  came earlier than the peaks say: workspaces, fragmentation, launch limits, an estimate off by
  any factor) could only creep below ``hi``, one size per trial; the search goes on from what
  ran instead (after one step at ``hi - 1`` when a line through measured peaks near ``hi`` is
  off by less than a sixteenth of the bracket): the geometric middle of ``lo`` and ``hi`` while
  ``hi`` is more than :data:`MAX_GROWTH` times ``lo``, then a third of the way up from ``lo``
  (:data:`FIT_SIDE_SPLIT`), then bisection; the same without any model once a size failed. It
  trusts a model again once its prediction is below ``hi`` (new measured peaks refit it).

Imports neither torch nor pynvml.

Example::

    points = [Point(micro_batch_size=1, fits=True, peak_bytes=1_100)]
    next_micro_batch_size(points, capacity_bytes=10_000, limit=4096, prior=None)   # 4 (growth)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from autobatch.errors import ConfigError
from autobatch.planning import fit_memory_model, fit_wide_line
from autobatch.profile import MemoryModel

__all__ = [
    "FIT_SIDE_MIN_SIZES",
    "FIT_SIDE_SPLIT",
    "MAX_GROWTH",
    "Point",
    "bracket",
    "estimate_budget_seconds",
    "fit_memory_model",
    "fit_wide_line",
    "growth_sizes",
    "next_micro_batch_size",
    "recommended_size",
    "trial_budget",
]

MAX_GROWTH = 4
"""Without a memory model, the next size is this many times the largest fitting size."""

FIT_SIDE_SPLIT = 3
"""Within a bracket of less than :data:`MAX_GROWTH` times, the search from what ran tries the
size a third of the way up from the largest that fitted. On an answer spread evenly over the
bracket, a split at ``p`` fails with probability ``p`` and learns ``H(p)`` bits (the binary
entropy): failures per bit ``p / H(p)`` are 0.36 at a third against 0.5 at the middle (27%
fewer), for ``1 / H(p)`` = 1.09 times the trials: over a bracket of 2**10 sizes, about the 3
spare trials of :func:`trial_budget`. Over 16 sizes or fewer a third rounds to a scan one or
two sizes at a time, and the search bisects.

Measured (``tests/probing/test_search.py``, thresholds 1..4096 under a limit of 20000, the
estimate proposing the limit): 6.7 failures on average, worst 10, where bisection after the
geometric middle took 7.8, worst 13."""

FIT_SIDE_MIN_SIZES = 16
"""Over this many sizes or fewer, the search from what ran bisects: a third of so few rounds to
a scan one or two sizes at a time."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    """The outcome of one trial, as the search sees it."""

    micro_batch_size: int
    fits: bool
    peak_bytes: int = 0
    """Measured peak (compared with the capacity); 0 when unknown (the trial ran out of memory).
    A trial that finished over the capacity (an estimate, or a CUDA step over budget) has
    ``fits=False`` and a known peak."""
    warm_up: bool = False
    """The step that created the optimizer state (micro-batch 1, or 2 for BatchNorm); it brackets
    the search but is not counted against :func:`trial_budget`."""


def bracket(points: Sequence[Point]) -> tuple[int, int | None]:
    """``(lo, hi)``: largest fitting size (0 if none) and smallest non-fitting size (None)."""
    lo = max((p.micro_batch_size for p in points if p.fits), default=0)
    hi = min((p.micro_batch_size for p in points if not p.fits), default=None)
    return lo, hi


def trial_budget(limit: int) -> int:
    """Most trials a search over sizes ``1..limit`` takes besides its warm-up step:
    ``ceil(log2(limit)) + 3``.

    Plain bisection after a warm-up at size 1 needs ``ceil(log2(limit))``; the three spare trials
    are what guided sizes may spend. Counting every real step the probe runs (the warm-up and the
    chosen size's second step included), the worst case is ``ceil(log2(limit)) + 5``.

    Raises:
        ConfigError: ``limit`` is not an int >= 1.
    """
    _check_limit(limit)
    return (limit - 1).bit_length() + 3


def _check_limit(limit: int) -> None:
    """Raises ConfigError unless ``limit`` (the largest size worth trying) is an int >= 1."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(
            f"limit {limit!r} must be an int >= 1 (the largest micro-batch size worth trying, "
            "e.g. max_micro_batch_size=65536)"
        )


def growth_sizes(limit: int) -> tuple[int, ...]:
    """The sizes the search runs before it has a line of measured peaks, without an estimate:
    :data:`MAX_GROWTH` and its square, within ``limit`` (4 and 16 under any limit of 16 or more).
    """
    return tuple(min(MAX_GROWTH**k, limit) for k in (1, 2) if MAX_GROWTH ** (k - 1) < limit)


def estimate_budget_seconds(
    *, limit: int, real_step_seconds: float, steps_scale_with_size: bool
) -> float:
    """Seconds the fake-tensor estimate may cost: the real steps it saves.

    With an estimate, the search's first real trial is the predicted size; without one, the
    search first grows to :func:`growth_sizes` (4 and 16), where the two measured peaks give it
    a line, then goes on as the estimate's would (the predicted size, one above). So the
    estimate saves at least those real steps: at ``real_step_seconds`` each (the warm-up
    step's measured time, at micro-batch 1) where a step's time does not grow with its size
    (a GPU's small steps, bound by kernel launches; a simulated card's set cost), and at that
    time the size where it does (a CPU). It saves more where a line through small sizes
    misleads the search (the optimizer step dominating their peaks): not counted.

    Example: 0.1 s a step, any limit of 16 or more: 0.2 s; on a CPU: 2.0 s.
    """
    sizes = growth_sizes(limit)
    steps = sum(sizes) if steps_scale_with_size else len(sizes)
    return steps * real_step_seconds


def _bisection_trials(lo: int, top: int) -> int:
    """Trials bisection needs when the answer is one of ``lo .. top - 1``."""
    return (top - lo - 1).bit_length()


def next_micro_batch_size(
    points: Sequence[Point],
    *,
    capacity_bytes: int,
    limit: int,
    prior: MemoryModel | None,
) -> int | None:
    """The next size to try, or None when the search is over.

    Args:
        points: every trial so far, in order (the warm-up included).
        capacity_bytes: peak bytes a step may reach.
        limit: largest size worth trying (>= 1).
        prior: an estimate of the memory line (e.g. from fake-tensor tracing), or None.

    Returns:
        A size in ``(lo, hi)`` (or ``(lo, limit]`` without an upper bound), never one already tried;
        None when ``hi == lo + 1``, when ``lo`` reached ``limit``, or when size 1 did not fit.

    Raises:
        ConfigError: ``limit`` is not an int >= 1.
    """
    _check_limit(limit)
    lo, hi = bracket(points)
    top = limit + 1 if hi is None else min(hi, limit + 1)  # sizes above limit count as failed
    if lo >= top - 1:
        return None
    guided = _guided(points, lo, hi, top, capacity_bytes=capacity_bytes, limit=limit, prior=prior)
    # Sizes from which bisection still ends within the budget, whatever the outcome: at most
    # 2**spare sizes left on either side. The midpoint is always among them.
    spare = trial_budget(limit) - _num_trials(points) - 1
    return min(max(guided, top - (1 << spare), lo + 1), lo + (1 << spare), top - 1)


def _guided(
    points: Sequence[Point],
    lo: int,
    hi: int | None,
    top: int,
    *,
    capacity_bytes: int,
    limit: int,
    prior: MemoryModel | None,
) -> int:
    """The model's (or growth's) proposal in ``(lo, top)``, or the search from what ran when the
    model is not to be trusted."""
    model = fit_memory_model(points, prior)
    if model is None:
        return min(MAX_GROWTH * lo if lo else 1, top - 1) if hi is None else _from_what_ran(lo, top)
    predicted = model.max_micro_batch_size(capacity_bytes)
    if hi is not None and predicted >= hi:
        # Contradicted: the model says hi fits, and it did not. A line through measured peaks
        # off by a little (allocator rounding) near hi (lo at least half of it) puts the max
        # just below hi: one step there. Far from what it was measured at, or off
        # by more, or once that step failed too, it could only creep down one size per trial:
        # the search goes on from what ran instead.
        measured = any(p.peak_bytes > 0 and p.micro_batch_size > 1 for p in points)
        near = measured and predicted - hi <= (hi - lo) // 16 and 2 * lo >= hi
        crept = any(not p.fits and p.micro_batch_size == hi + 1 for p in points)
        return hi - 1 if near and not crept and hi - 1 > lo else _from_what_ran(lo, top)
    guided = max(lo + 1, min(predicted, top - 1))
    if _num_trials(points) + 1 + _bisection_trials(guided, top) >= trial_budget(limit):
        # A fit at the predicted max would leave no spare trial to confirm it: aim one above
        # instead, where a failure agrees with the model and caps the bracket (the predicted max
        # comes next, and bisection below it is cheap).
        guided = max(lo + 1, min(predicted + 1, top - 1))
    return guided


def _from_what_ran(lo: int, top: int) -> int:
    """Search from what ran: the geometric middle of ``lo`` (the largest size that fitted) and
    ``top`` while ``top`` is more than :data:`MAX_GROWTH` times ``lo``, then a split at the lower
    :data:`FIT_SIDE_SPLIT` of the bracket.

    After a failure the peaks did not predict (an estimate that proposed the limit, say), the
    answer is as likely near the sizes that ran as near the one that failed, on a log scale:
    the geometric middle finds its scale in ``log2(log2(top / lo))`` trials, where bisection
    from a far ``top`` fails at every step above the answer. Within a factor of
    :data:`MAX_GROWTH` the answer is about as likely anywhere in the bracket, and a failure
    costs a clean-up (and, on a real card, can fragment the cache): the split nearer ``lo``
    fails less often, for a few more trials; over :data:`FIT_SIDE_MIN_SIZES` sizes or fewer,
    bisection. The safeguard in
    :func:`next_micro_batch_size` moves it towards the middle when the budget needs that.
    """
    if lo > 0 and top > MAX_GROWTH * lo:
        return max(lo + 1, math.isqrt(lo * top))
    if top - lo > FIT_SIDE_MIN_SIZES:
        return lo + (top - lo) // FIT_SIDE_SPLIT
    return (lo + top) // 2


def _num_trials(points: Sequence[Point]) -> int:
    """Trials counted against the budget: all but the warm-up."""
    return sum(1 for p in points if not p.warm_up)


def recommended_size(
    points: Sequence[Point],
    *,
    capacity_bytes: int,
    safety_margin: float,
    model: MemoryModel | None,
    warm_up_peak_bytes: int = 0,
) -> int:
    """Largest fitting size whose peak keeps ``safety_margin`` of the capacity free; when none
    does, the warm-up's size (1, or 2 where 1 cannot train).

    Uses measured peaks where the size was tried, the memory model between them. The model never
    outranks a measurement: no size at or above one whose peak broke the margin is recommended,
    whatever the line says, since peaks grow with the size. ``warm_up_peak_bytes`` is the warm-up
    step's peak (0: unknown), which the warm-up's point does not carry (the optimizer state it
    created would tilt the search's lines): every later step holds that state too, so it bounds
    the peak of every size from the warm-up's up.
    """
    lo, _ = bracket(points)
    budget = int(capacity_bytes * (1 - safety_margin))
    warm_up = min((p.micro_batch_size for p in points if p.warm_up and p.fits), default=None)
    measured = {p.micro_batch_size: p.peak_bytes for p in points if p.fits and p.peak_bytes > 0}
    over = [n for n, peak in measured.items() if peak > budget]
    if warm_up is not None and warm_up_peak_bytes > budget:
        over.append(warm_up)
    best = max((n for n, peak in measured.items() if peak <= budget), default=warm_up or 1)
    if model is not None:
        predicted = min(lo, model.max_micro_batch_size(budget))
        if over:
            predicted = min(predicted, min(over) - 1)
        best = max(best, predicted)
    return max(1, min(best, lo)) if lo else 1
