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
   :mod:`autobatch.planning._lines` and re-exported here; the secant's max is taken in exact
   arithmetic, :func:`_secant_max`). The prior is the estimate's line, or without one the line
   from the resident bytes through the warm-up's peak (:func:`warm_up_line`): a well-behaved
   model then takes its max and one above, 1 OOM;
2. without any model (no prior, fewer than two different peaks), or with one that says every
   size up to the limit fits, the search from what ran (below): nothing then says where a real
   step would fail. Fake steps (the estimate's, ``failures_follow_peaks``), which fail only
   where their peaks pass the capacity, grow instead: 4x the largest fitting size.

A guided size is only a proposal. It is taken while it is *safe* (in the spirit of Brent's
safeguards, on integers), otherwise the search from what ran takes over:

- **the budget**: ``ceil(log2(limit)) + 3`` trials besides the warm-up step that creates the
  optimizer state (:func:`trial_budget`). A guided size is moved (towards the middle of the
  bracket) until, whatever its outcome, bisection could still finish within the budget; so for
  any failure pattern that is monotone in the size, the search ends at the exact max within the
  budget, whatever the peaks say. Counting every real step the probe runs (one warm-up, and the
  chosen size's second step), the worst case is ``ceil(log2(limit)) + 5``;
- **the model must not be contradicted**: a model that predicts the failed ``hi`` fits (the failure
  came earlier than the peaks say: workspaces, fragmentation, launch limits, an estimate off by
  any factor) could only creep below ``hi``, one size per trial; the search goes on from what
  ran instead (after one step at ``hi - 1`` when a line through measured peaks near ``hi`` is
  off by less than a sixteenth of the bracket). It trusts a model again once its prediction is
  below ``hi`` (new measured peaks refit it).

**The search from what ran** (:func:`_from_what_ran`) is the dynamic programme of
``bench/search_bounds.py`` taken one trial ahead: the answer log-uniform over the bracket, each
side of a split costed by the egg-drop count (the least worst-case failures with the trials
left), among the splits that keep every answer within :data:`DOUBLING_EXCESS` failures of
doubling-then-bisect's (:func:`_reach`). Where trials are plenty it scans upwards (one failure in
all); where they are not, it splits nearer the middle. On every threshold of the benchmark's
sweeps (limits 256, 4096 and 20000, thresholds nothing predicts) it stays within doubling's
OOMs + 2 and the stated worst case, from the warm-up alone and after an estimate's failed jump
to the limit; from the warm-up, fewer OOMs than doubling on average (2.51 against 2.88 at 256,
the least any search within 13 real steps reaches).

Imports neither torch nor pynvml.

Example::

    points = [Point(micro_batch_size=1, fits=True, warm_up=True)]
    next_micro_batch_size(points, capacity_bytes=10_000, limit=4096, prior=None)   # 107
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from autobatch.errors import ConfigError
from autobatch.planning import fit_memory_model, fit_wide_line
from autobatch.profile import MemoryModel

__all__ = [
    "DOUBLING_EXCESS",
    "MAX_GROWTH",
    "Point",
    "bracket",
    "doubling_failures",
    "estimate_budget_seconds",
    "fit_memory_model",
    "fit_wide_line",
    "growth_sizes",
    "next_micro_batch_size",
    "recommended_size",
    "trial_budget",
    "warm_up_line",
]

MAX_GROWTH = 4
"""Fake steps without a memory model (``failures_follow_peaks``) grow by this factor from the
largest fitting size."""

DOUBLING_EXCESS = 2
"""The search from what ran keeps every answer within this many failures of doubling-then-bisect's
(:func:`doubling_failures`), where the budget allows: within ``ceil(log2(limit)) + 3`` trials it
always does, from the warm-up alone or after a failed first trial at the limit
(``bench/search_bounds.py``'s least worst excess is 1 and 2 there; 2 is the least that holds on
both)."""


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


def warm_up_line(
    points: Sequence[Point], *, warm_up_peak_bytes: int, fixed_bytes: int
) -> MemoryModel | None:
    """The line from the model's resident bytes (``fixed_bytes``: weights, buffers and optimizer
    state, known once the warm-up created the state) through the warm-up step's measured peak,
    or None where that peak is not above them (unknown, or nothing to fit).

    Every step holds the resident bytes throughout, so a step's line starts at or above them,
    and the warm-up's peak may be the optimizer step's rather than the activations' (DESIGN.md:
    peak memory is ``max(optimizer_step_peak, fixed + activations * n)``): this line's slope is
    then too steep and its max too small, errors on the side that fits. The search follows it
    as any prior, and refits it from those bytes through the largest measured peak (again a max
    no larger than the true one, on a line), then through two measured peaks.

    Example: fixed 1,000 bytes, a peak of 1,100 at micro-batch 1: 100 bytes a sample.
    """
    size = max((p.micro_batch_size for p in points if p.warm_up and p.fits), default=0)
    if size == 0 or warm_up_peak_bytes <= fixed_bytes:
        return None
    per_sample = -(-(warm_up_peak_bytes - fixed_bytes) // size)
    return MemoryModel(fixed_bytes=fixed_bytes, bytes_per_sample=per_sample)


def growth_sizes(
    limit: int, *, capacity_bytes: int = 0, line: MemoryModel | None = None
) -> tuple[int, ...]:
    """The sizes the search runs from the warm-up (at 1) without an estimate before its own
    measured peaks give it a line: the first two it proposes where the first fits with its peak
    on ``line`` (the warm-up's, :func:`warm_up_line`).

    Following a line that predicts a max under ``limit``, that is the line's size and one above
    it (99 and 100 for 100 bytes a sample over 1,000 fixed in 10,900); with no line, or one that
    says every size fits, the first two of the search from what ran (4049 and 24311 under a
    limit of 65536; the limit itself where one size is left).

    Raises:
        ConfigError: ``limit`` is not an int >= 1.
    """
    points = [Point(micro_batch_size=1, fits=True, warm_up=True)]
    sizes: list[int] = []
    for _ in range(2):
        size = next_micro_batch_size(points, capacity_bytes=capacity_bytes, limit=limit, prior=line)
        if size is None:
            break
        sizes.append(size)
        peak = 0 if line is None else line.peak_bytes(size)
        points.append(Point(micro_batch_size=size, fits=True, peak_bytes=peak))
    return tuple(sizes)


def estimate_budget_seconds(
    *,
    limit: int,
    real_step_seconds: float,
    steps_scale_with_size: bool,
    capacity_bytes: int = 0,
    line: MemoryModel | None = None,
) -> float:
    """Seconds the fake-tensor estimate may cost: the real steps it saves.

    With an estimate, the search's first real trial is the predicted size; without one, the
    search from the warm-up first runs :func:`growth_sizes` (following the warm-up's ``line``
    where it predicts a max under ``limit``: its size and one above; else the search from what
    ran's first two, 4049 and 24311 under a limit of 65536), then goes on from the measured
    peaks. So the estimate saves at least those real steps: at ``real_step_seconds`` each (the
    warm-up step's measured time, at micro-batch 1) where a step's time does not grow with its
    size (a GPU's small steps, bound by kernel launches; a simulated card's set cost), and at
    that time the size where it does (a CPU). It saves more where the warm-up's line misleads
    the search (the optimizer step dominating its peak): not counted.

    Example: 0.1 s a step, a limit of 4 or more: 0.2 s; on a CPU, under a limit of 256 without a
    line (12 and 58): 7.0 s; with a line of 100 bytes a sample over 1,000 in 10,900 (99, 100):
    19.9 s.
    """
    sizes = growth_sizes(limit, capacity_bytes=capacity_bytes, line=line)
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
    failures_follow_peaks: bool = False,
) -> int | None:
    """The next size to try, or None when the search is over.

    Args:
        points: every trial so far, in order (the warm-up included).
        capacity_bytes: peak bytes a step may reach.
        limit: largest size worth trying (>= 1).
        prior: an estimate of the memory line (e.g. from fake-tensor tracing), or None.
        failures_follow_peaks: a trial fails only where its peak passes the capacity (fake
            steps, which always finish): growth and a line that says every size fits are
            followed. Otherwise (real steps, which can fail where the peaks do not say)
            the search without a line, or with one that says every size fits, is the search
            from what ran.

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
    guided = _guided(
        points,
        lo,
        hi,
        top,
        capacity_bytes=capacity_bytes,
        limit=limit,
        prior=prior,
        failures_follow_peaks=failures_follow_peaks,
    )
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
    failures_follow_peaks: bool,
) -> int:
    """The model's (or growth's) proposal in ``(lo, top)``, or the search from what ran when the
    model is not to be trusted."""
    model = fit_memory_model(points, prior)
    predicted = None if model is None else model.max_micro_batch_size(capacity_bytes)
    secant = _secant_max(points, capacity_bytes)
    if predicted is not None and secant is not None:
        predicted = secant
    if hi is None and lo == 0:
        return 1
    if hi is None and not failures_follow_peaks and (predicted is None or predicted >= limit):
        # No line, or one that says every size fits: nothing says where a real step would
        # fail (a workspace, a launch limit), and a jump to the limit fails wherever one does.
        return _from_what_ran(points, lo, top, limit=limit)
    if model is None or predicted is None:
        if hi is None:
            return min(MAX_GROWTH * lo, top - 1)
        return _from_what_ran(points, lo, top, limit=limit)
    if hi is not None and predicted >= hi:
        # Contradicted: the model says hi fits, and it did not. A line through measured peaks
        # off by a little (allocator rounding) near hi (lo at least half of it) puts the max
        # just below hi: one step there. Far from what it was measured at, or off
        # by more, or once that step failed too, it could only creep down one size per trial:
        # the search goes on from what ran instead.
        measured = any(p.peak_bytes > 0 and p.micro_batch_size > 1 for p in points)
        near = measured and predicted - hi <= (hi - lo) // 16 and 2 * lo >= hi
        crept = any(not p.fits and p.micro_batch_size == hi + 1 for p in points)
        if near and not crept and hi - 1 > lo:
            return hi - 1
        return _from_what_ran(points, lo, top, limit=limit)
    guided = max(lo + 1, min(predicted, top - 1))
    if _num_trials(points) + 1 + _bisection_trials(guided, top) >= trial_budget(limit):
        # A fit at the predicted max would leave no spare trial to confirm it: aim one above
        # instead, where a failure agrees with the model and caps the bracket (the predicted max
        # comes next, and bisection below it is cheap).
        guided = max(lo + 1, min(predicted + 1, top - 1))
    return guided


def _secant_max(points: Sequence[Point], capacity_bytes: int) -> int | None:
    """The max of :func:`fit_memory_model`'s line through the two latest measured peaks (the
    latest, and the latest before it of another size and peak), in exact integer arithmetic;
    None where there is no such pair.

    The fitted line's slope is rounded up to whole bytes per sample, which can put its max one
    size low 500 sizes from the points: the search would then aim one above the max at the max
    itself, which fits, and leave no spare trial.
    """
    known = [p for p in points if p.peak_bytes > 0]
    if not known:
        return None
    last = known[-1]
    recent = [
        p
        for p in known
        if p.micro_batch_size != last.micro_batch_size and p.peak_bytes != last.peak_bytes
    ]
    if not recent:
        return None
    small, large = sorted((recent[-1], last), key=lambda p: p.micro_batch_size)
    if large.peak_bytes <= small.peak_bytes:
        return None
    sizes = large.micro_batch_size - small.micro_batch_size
    spare = (capacity_bytes - large.peak_bytes) * sizes // (large.peak_bytes - small.peak_bytes)
    return max(0, large.micro_batch_size + spare)


def _from_what_ran(points: Sequence[Point], lo: int, top: int, *, limit: int) -> int:
    """Search from what ran: the split of ``lo`` (the largest size that fitted) .. ``top`` (the
    smallest counted as failed) with the fewest expected failures, among those that keep every
    answer within :data:`DOUBLING_EXCESS` failures of doubling-then-bisect's.

    The answer is taken as log-uniform over ``lo .. top - 1`` (a max of 3 as likely as one of
    3,000), and each side of a split ``m`` as costing the least worst-case failures any search
    needs there with the trials left (:func:`_least_failures`, the egg-drop count): one trial
    ahead, that is the dynamic programme's choice (``bench/search_bounds.py``: 2.51 failures
    on average from the warm-up at a limit of 256, its least). The candidates are the splits
    that leave one side exactly as many sizes as ``f`` failures settle, for every ``f``, the
    largest whose failing side stays within the bar, and the two ends of the budget's window.
    Where trials are plenty (a few small sizes) that scans upwards, one failure in all; where
    they are not, it splits nearer the middle. A split is kept only where both of its sides
    can still be settled within the bar and the budget (:func:`_reach`); where none can (a
    model followed earlier spent the failures), the cheapest split still ends within the
    budget.
    """
    trials_left = trial_budget(limit) - _num_trials(points)
    if trials_left < 1:  # past the budget (a second step that failed): bisect
        return (lo + top) // 2
    window_lo = max(lo + 1, top - (1 << (trials_left - 1)))
    window_hi = min(top - 1, lo + (1 << (trials_left - 1)))
    if window_lo > window_hi:
        return (lo + top) // 2
    shift = DOUBLING_EXCESS - sum(1 for p in points if not p.fits)
    candidates = {window_lo, window_hi, (lo + top) // 2}
    candidates.add(_reach(max(lo, 1), trials_left - 1, shift - 1, limit))
    for failures in range(trials_left):
        settled = _sizes_settled(trials_left - 1, failures)
        candidates.update((lo + settled, top - settled))
    span = _log_size(top) - _log_size(lo)

    def cost(m: int) -> tuple[bool, float, int]:
        within = lo >= 1 and (
            m <= _reach(lo, trials_left - 1, shift - 1, limit)
            and top <= _reach(m, trials_left - 1, shift, limit)
        )
        below = (_log_size(m) - _log_size(lo)) / span  # the chance that m fails
        fail = 1 + _least_failures(trials_left - 1, m - lo)
        fit = _least_failures(trials_left - 1, top - m)
        return not within, below * fail + (1 - below) * fit, m

    return min((m for m in candidates if window_lo <= m <= window_hi), key=cost)


def _log_size(n: int) -> float:
    """The log-uniform position of size ``n`` (0 counts as a half: the answer may be 0 only
    where no warm-up ran)."""
    return math.log(max(n, 0.5))


@functools.cache
def _sizes_settled(trials: int, failures: int) -> int:
    """How many candidate answers ``trials`` trials settle with at most ``failures`` failures:
    ``sum(comb(trials, i) for i in 0..failures)`` (the egg-drop count; 0 below no failures)."""
    if failures < 0:
        return 0
    return sum(math.comb(trials, i) for i in range(min(failures, trials) + 1))


def _least_failures(trials: int, sizes: int) -> int:
    """The least worst-case failures of any search that settles among ``sizes`` candidate
    answers within ``trials`` trials (``trials + 1`` where none can)."""
    failures = 0
    while failures <= trials and _sizes_settled(trials, failures) < sizes:
        failures += 1
    return failures


@functools.lru_cache(maxsize=1 << 18)
def _reach(lo: int, trials: int, shift: int, limit: int) -> int:
    """The largest ``top`` such that the answers ``lo .. top - 1`` (``lo`` >= 1 known to fit,
    ``top`` to fail) can be settled within ``trials`` trials with each answer ``t`` failing at
    most ``doubling_failures(t, limit) + shift`` more times; ``lo`` where not even ``t = lo``
    can.

    The egg-drop recursion with an allowance per answer: the failing side of the first split
    may hold answers up to ``_reach(lo, trials - 1, shift - 1)``, and the fitting side, from
    there, up to ``_reach(that, trials - 1, shift)``. Answers above ``limit`` do not exist.
    """
    if lo > limit:
        return 2 * limit + 2  # no answer left to settle: any top
    if doubling_failures(lo, limit) + shift < 0:
        return lo
    if trials == 0:
        return lo + 1
    split = _reach(lo, trials - 1, shift - 1, limit)
    if split <= lo:
        return lo + 1
    return max(lo + 1, _reach(split, trials - 1, shift, limit))


@functools.lru_cache(maxsize=1 << 18)
def doubling_failures(t: int, limit: int) -> int:
    """Failures of doubling-then-bisect when sizes up to ``t`` fit (1 <= ``t`` <= ``limit``):
    PyTorch Lightning's ``BatchSizeFinder(mode="binsearch")``, after a warm-up at 1: 2, 4, 8,
    ... while they fit (the last capped at ``limit``), then halving the bracket.

    Example: ``doubling_failures(37, 20_000)`` is 4 (2 .. 32 fit, 64, 48, 40 fail, 36, 38, 37).
    """
    low, high, size = 1, 0, 2
    failures = 0
    while True:
        if size <= t:
            low = size
            if high:
                if high - low <= 1:
                    return failures
                size = (high + low) // 2
            elif size >= limit:
                return failures
            else:
                size = min(2 * size, limit)
        else:
            failures += 1
            high = size
            if high - low <= 1:
                return failures
            size = (high + low) // 2


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
