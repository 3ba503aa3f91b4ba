"""How many OOMs a search for the largest micro-batch needs when nothing predicts the failure:
autobatch's search beside a model of Lightning's binsearch and the best searches that keep a
budget of real steps, all pure (no model, no device), in one run per limit.

The failure threshold ``t`` (the largest size that fits) is drawn log-uniform on ``1 .. limit``
(``t`` with weight ``log((t + 1) / t)``: a max of 3 is as likely as one of 3,000 on a scale of
decades). Each search gets the outcome of every size it tries (fits when ``size <= t``) and must
end knowing ``t`` exactly. Every real step is counted: autobatch's warm-up (at 1) and the chosen
size's second step included. Rows, each over every ``t`` (means weighted):

- ``autobatch, estimate contradicted``: the estimate's peaks say every size fits, so its first
  trial is the limit, which fails (``oom-above-37`` in ``probe_vs_peers.py`` is one such ``t``);
  then autobatch's search from what ran (``autobatch.probing.next_micro_batch_size``).
- ``autobatch, no estimate``: the search from the warm-up alone, with no line to follow (the
  peaks say every size fits, or the warm-up's peak is unknown): the search from what ran.
- ``autobatch, line right``: the road of a well-behaved model without an estimate (a GPU's,
  where real steps are cheaper than fake ones): the line from the model's fixed bytes through
  the warm-up's peak predicts the max, the peaks follow it, and the search tries the max and
  one above (1 OOM and 4 real steps on every ``t`` under the limit; at the limit the line says
  every size fits, which says nothing of where a real step would fail: from what ran).
- ``Lightning binsearch (model)``: ``BatchSizeFinder(mode="binsearch")``'s loop as Lightning 2.x
  writes it (``_run_binary_scaling``: start at 2, double while it fits, then halve the bracket),
  without its ``max_trials`` cap of 25 (no ``t`` here needs that many).

Columns beside Lightning (``dbl``, its OOMs on the same ``t``): the largest excess
``OOMs(t) - dbl(t)`` over every ``t``, and how many ``t`` exceed ``dbl(t) + 2``.

Then bounds, by dynamic programming over brackets ``(lo, hi)`` and trials left (cubic in the
limit, so only up to ``--dp-max``), for two budgets of real steps: ``ceil(log2(limit)) + 3``
(the bar the probe is held to) and ``ceil(log2(limit)) + 5`` (autobatch's stated worst case),
each from the warm-up alone (``from scratch``) and after the estimate's failed limit trial:

- ``least mean OOMs``: no search within that budget has fewer on average over this prior;
- ``least worst excess``: no search within that budget keeps ``OOMs(t) - dbl(t)`` lower on every
  ``t``;
- for the stated worst case, ``every t within dbl + 2``: the least mean OOMs of a search that also
  keeps ``OOMs(t) <= dbl(t) + 2`` on every ``t`` (issue 47's per-threshold bar), the mean that a
  search meeting both of its bars can reach at best.

A bound above Lightning's mean (or a least worst excess above 2) says that no search, autobatch's
or any other, can meet that bar within that budget: the bar is out of reach there, not a tuning
away.

Usage::

    .venv/bin/python bench/search_bounds.py                    # limits 256, 4096, 20000
    .venv/bin/python bench/search_bounds.py --limits 512 --dp-max 512
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from autobatch.probing import Point, bracket, next_micro_batch_size, trial_budget
from autobatch.profile import MemoryModel

# Peaks that say every size fits: the estimate's line for a step that fails for another reason.
_TINY = MemoryModel(fixed_bytes=1_000, bytes_per_sample=1)
# A line that is right: the model's fixed bytes and its activations per sample, the peaks on it.
_RIGHT = MemoryModel(fixed_bytes=10**9, bytes_per_sample=10**6)
_CAPACITY_BYTES = 10**12

Search = Callable[[int, int], tuple[int, int]]
"""``search(t, limit) -> (real steps, failures)``."""


def autobatch_search(*, road: str) -> Search:
    """autobatch's search on threshold ``t`` along ``road``: ``contradicted`` (the estimate's
    line says every size fits: the limit is tried first), ``scratch`` (no line: peaks that say
    every size fits, as tiny ones do) or ``line`` (the warm-up's line is right: peaks linear, the
    capacity between ``t``'s peak and ``t + 1``'s). Its real steps: the warm-up, every search
    trial, and the chosen size's second step."""

    def run(t: int, limit: int) -> tuple[int, int]:
        points = [Point(micro_batch_size=1, fits=True, warm_up=True)]
        capacity, line = _CAPACITY_BYTES, _TINY
        if road == "line":
            line = _RIGHT
            capacity = _RIGHT.peak_bytes(t) + _RIGHT.bytes_per_sample // 2
        prior = None if road == "scratch" else line
        size: int | None = limit if road == "contradicted" and limit > 1 else None
        if size is None:
            size = next_micro_batch_size(points, capacity_bytes=capacity, limit=limit, prior=prior)
        while size is not None:
            fits = size <= t
            peak = line.peak_bytes(size) if fits else 0
            points.append(Point(micro_batch_size=size, fits=fits, peak_bytes=peak))
            size = next_micro_batch_size(points, capacity_bytes=capacity, limit=limit, prior=prior)
        assert bracket(points)[0] == t, (t, [p.micro_batch_size for p in points])
        return len(points) + 1, sum(not p.fits for p in points)

    return run


def lightning_binsearch(t: int, limit: int) -> tuple[int, int]:
    """Lightning's ``_run_binary_scaling`` on threshold ``t`` (its trial at 2 counted; sizes
    above ``limit`` never tried, as its dataset length caps them)."""
    low, high, size = 1, 0, 2
    trials = failures = 0
    while True:
        trials += 1
        if size <= t:
            low = size
            if high:
                if high - low <= 1:
                    break
                size = (high + low) // 2
            elif size >= limit:
                break
            else:
                size = min(2 * size, limit)
        else:
            failures += 1
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
    assert low == t, (t, low, high)
    return trials, failures


def best_mean_failures(limit: int, trials: int, *, limit_failed: bool) -> float:
    """The least weighted-mean failures of any search that ends within ``trials`` trials.

    ``E[k][lo][d]``: the least expected failures with ``k`` trials left when ``lo`` fits and
    ``lo + d`` fails (the threshold in ``lo .. lo + d - 1``); trying ``m = lo + j`` splits it.
    """
    top = limit if limit_failed else limit + 1  # the first size known (or counted) to fail
    weights = np.array([0.0] + [math.log((t + 1) / t) for t in range(1, top + 1)])
    cumulative = np.concatenate([[0.0], np.cumsum(weights)])  # C[x] = sum of w(1 .. x - 1)
    inf = float("inf")
    previous = np.full((top + 1, top + 1), inf)
    previous[:, 1] = 0.0  # a bracket of one size: known
    for _ in range(trials):
        current = np.full((top + 1, top + 1), inf)
        current[:, 1] = 0.0
        for d in range(2, top):
            lo = np.arange(1, top - d + 1)  # lo + d <= top
            j = np.arange(1, d)
            mass = cumulative[lo + d] - cumulative[lo]
            fit_mass = cumulative[lo + d][:, None] - cumulative[lo[:, None] + j]
            fail_mass = cumulative[lo[:, None] + j] - cumulative[lo][:, None]
            fit_cost = previous[lo[:, None] + j, d - j]
            fail_cost = 1.0 + previous[lo[:, None], j]
            with np.errstate(invalid="ignore"):
                cost = np.where(fit_mass > 0, fit_mass * fit_cost, 0.0) + np.where(
                    fail_mass > 0, fail_mass * fail_cost, 0.0
                )
            current[lo, d] = cost.min(axis=1) / mass
        previous = current
    return float(previous[1, top - 1])


def least_worst_excess(limit: int, trials: int, *, limit_failed: bool) -> int:
    """The least ``max_t (failures(t) - lightning(t))`` of any search that ends within ``trials``
    trials (the limit's failed trial counted in the failures when ``limit_failed``).

    ``G[k][lo][d]``: with ``k`` trials left, ``lo`` fitting and ``lo + d`` failing, the least
    worst excess of the failures still to come over Lightning's on ``lo .. lo + d - 1``.
    """
    top = limit if limit_failed else limit + 1
    lightning = np.array([0] + [lightning_binsearch(t, limit)[1] for t in range(1, top)] + [0])
    never = 10**6
    previous = np.full((top + 1, top + 1), never, dtype=np.int64)
    previous[:top, 1] = -lightning[:top]  # a bracket of one size: known
    for _ in range(trials):
        current = np.full((top + 1, top + 1), never, dtype=np.int64)
        current[:top, 1] = -lightning[:top]
        for d in range(2, top):
            lo = np.arange(1, top - d + 1)
            j = np.arange(1, d)
            fit = previous[lo[:, None] + j, d - j]
            fail = 1 + previous[lo[:, None], j]
            current[lo, d] = np.maximum(fit, fail).min(axis=1)
        previous = current
    return int(previous[1, top - 1]) + int(limit_failed)


def best_mean_within_excess(limit: int, trials: int, *, limit_failed: bool, excess: int) -> float:
    """The least weighted-mean failures of any search that ends within ``trials`` trials and
    keeps ``failures(t) - lightning(t) <= excess`` on every ``t`` (the limit's failed trial
    counted when ``limit_failed``); ``inf`` where no search can.

    ``E[r][k][lo][d]``: as in :func:`best_mean_failures`, with ``r`` the excess still allowed:
    every ``t`` left may fail at most ``lightning(t) + r`` more times. A failure lowers ``r`` by
    one; a bracket of one size is settled where ``r >= -lightning(t)``.
    """
    top = limit if limit_failed else limit + 1
    weights = np.array([0.0] + [math.log((t + 1) / t) for t in range(1, top + 1)])
    cumulative = np.concatenate([[0.0], np.cumsum(weights)])
    lightning = np.array([0] + [lightning_binsearch(t, limit)[1] for t in range(1, top)] + [0])
    allowances = range(-int(lightning.max()), excess + 1)  # r below these settles nothing
    inf = float("inf")
    settled = np.full((len(allowances), top + 1), inf)
    for i, r in enumerate(allowances):
        settled[i, :top] = np.where(-lightning[:top] <= r, 0.0, inf)
    previous = np.full((len(allowances), top + 1, top + 1), inf)
    previous[:, :, 1] = settled
    for _ in range(trials):
        current = np.full_like(previous, inf)
        current[:, :, 1] = settled
        for d in range(2, top):
            lo = np.arange(1, top - d + 1)
            j = np.arange(1, d)
            mass = cumulative[lo + d] - cumulative[lo]
            fit_mass = cumulative[lo + d][:, None] - cumulative[lo[:, None] + j]
            fail_mass = cumulative[lo[:, None] + j] - cumulative[lo][:, None]
            for i in range(1, len(allowances)):  # i = 0 allows no failure at all: stays inf
                fit_cost = previous[i][lo[:, None] + j, d - j]
                fail_cost = 1.0 + previous[i - 1][lo[:, None], j]
                cost = fit_mass * fit_cost + fail_mass * fail_cost
                current[i, lo, d] = cost.min(axis=1) / mass
        previous = current
    start = allowances.index(excess - int(limit_failed))
    return float(previous[start, 1, top - 1]) + int(limit_failed)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """One search over every threshold ``1..limit``."""

    mean_steps: float
    worst_steps: int
    mean_failures: float
    worst_failures: int
    worst_excess: int
    """Largest ``failures(t) - lightning(t)``."""
    over_two: int
    """Thresholds where ``failures(t) > lightning(t) + 2``."""


def summarize(search: Search, limit: int) -> Summary:
    """``search`` over every ``t`` in ``1..limit``, weighted log-uniform, beside Lightning."""
    total = steps_sum = failures_sum = 0.0
    worst_steps = worst_failures = over_two = 0
    worst_excess = -limit
    for t in range(1, limit + 1):
        weight = math.log((t + 1) / t)
        steps, failures = search(t, limit)
        excess = failures - lightning_binsearch(t, limit)[1]
        total += weight
        steps_sum += weight * steps
        failures_sum += weight * failures
        worst_steps = max(worst_steps, steps)
        worst_failures = max(worst_failures, failures)
        worst_excess = max(worst_excess, excess)
        over_two += excess > 2
    return Summary(
        mean_steps=steps_sum / total,
        worst_steps=worst_steps,
        mean_failures=failures_sum / total,
        worst_failures=worst_failures,
        worst_excess=worst_excess,
        over_two=over_two,
    )


def weighted(search: Search, limit: int) -> tuple[float, float, int, int]:
    """``(mean steps, mean failures, worst steps, worst failures)`` over ``t`` in 1..limit."""
    summary = summarize(search, limit)
    return (
        summary.mean_steps,
        summary.mean_failures,
        summary.worst_steps,
        summary.worst_failures,
    )


def bound_rows(limit: int) -> list[tuple[str, ...]]:
    """The DP bounds for the two budgets of real steps, from scratch and after the failed limit.

    Real steps besides the search's trials: the warm-up and the second step (2), and the limit's
    failed trial after the estimate (1 more).
    """
    rows: list[tuple[str, ...]] = []
    bits = (limit - 1).bit_length()
    for extra in (3, 5):
        steps = bits + extra
        scratch = steps - 2
        after = steps - 3
        rows.append(
            (
                f"best within {steps} real steps, from scratch",
                "",
                str(steps),
                f"{best_mean_failures(limit, scratch, limit_failed=False):.2f}",
                "",
                str(least_worst_excess(limit, scratch, limit_failed=False)),
                "",
            )
        )
        rows.append(
            (
                f"best within {steps} real steps, after the failed limit",
                "",
                str(steps),
                f"{1.0 + best_mean_failures(limit, after, limit_failed=True):.2f}",
                "",
                str(least_worst_excess(limit, after, limit_failed=True)),
                "",
            )
        )
        if extra == 5:
            for label, trials, failed in (
                ("from scratch", scratch, False),
                ("after the failed limit", after, True),
            ):
                mean = best_mean_within_excess(limit, trials, limit_failed=failed, excess=2)
                rows.append(
                    (
                        f"best within {steps} real steps, {label}, every t within dbl + 2",
                        "",
                        str(steps),
                        f"{mean:.2f}",
                        "",
                        "<= +2" if mean < math.inf else "none",
                        "0",
                    )
                )
    return rows


@functools.cache
def road_summary(road: str, limit: int) -> Summary:
    """:func:`summarize` of ``road`` (``contradicted``, ``scratch``, ``line`` or ``lightning``),
    once."""
    search: Search = {
        "contradicted": autobatch_search(road="contradicted"),
        "scratch": autobatch_search(road="scratch"),
        "line": autobatch_search(road="line"),
        "lightning": lightning_binsearch,
    }[road]
    return summarize(search, limit)


def goal_lines(limit: int) -> list[str]:
    """Issue 47's bars at ``limit``, each MET or MISSED with what was measured: from scratch,
    fewer mean OOMs than doubling; on both roads, no threshold over doubling's OOMs + 2 and every
    threshold within ``ceil(log2(limit)) + 5`` real steps; every answer exact (asserted)."""
    worst_case = (limit - 1).bit_length() + 5
    doubling = road_summary("lightning", limit)
    scratch = road_summary("scratch", limit)
    lines = [
        _goal(
            scratch.mean_failures < doubling.mean_failures,
            f"from scratch, fewer mean OOMs than doubling: {scratch.mean_failures:.2f} "
            f"against {doubling.mean_failures:.2f}",
        )
    ]
    for road, s in (
        ("from scratch", scratch),
        ("estimate contradicted", road_summary("contradicted", limit)),
    ):
        lines.append(
            _goal(
                s.over_two == 0,
                f"{road}, every threshold within doubling's OOMs + 2: worst {s.worst_excess:+d}, "
                f"{s.over_two} over",
            )
        )
        lines.append(
            _goal(
                s.worst_steps <= worst_case,
                f"{road}, within ceil(log2(limit)) + 5 = {worst_case} real steps: worst "
                f"{s.worst_steps}",
            )
        )
    # Under the limit: a line that says the limit fits says every size does, and nothing then
    # says where a real step would fail (the search from what ran, as from scratch).
    below = [autobatch_search(road="line")(t, limit) for t in range(1, limit)]
    lines.append(
        _goal(
            max(f for _, f in below) <= 1 and max(s for s, _ in below) <= 4,
            f"line right, at most 1 OOM and 4 real steps on every threshold under the limit: "
            f"worst {max(f for _, f in below)} OOM, {max(s for s, _ in below)} real steps",
        )
    )
    return lines


def _goal(met: bool, text: str) -> str:
    return f"goal {'MET   ' if met else 'MISSED'} {text}"


def table(limit: int, *, dp: bool) -> str:
    """The rows for one limit, as aligned text."""
    rows: list[tuple[str, ...]] = []
    for name, road in (
        ("autobatch, estimate contradicted", "contradicted"),
        ("autobatch, no estimate", "scratch"),
        ("autobatch, line right", "line"),
        ("Lightning binsearch (model)", "lightning"),
    ):
        s = road_summary(road, limit)
        rows.append(
            (
                name,
                f"{s.mean_steps:.2f}",
                str(s.worst_steps),
                f"{s.mean_failures:.2f}",
                str(s.worst_failures),
                f"{s.worst_excess:+d}",
                str(s.over_two),
            )
        )
    if dp:
        rows.extend(bound_rows(limit))
    header = (
        "search",
        "mean steps",
        "worst steps",
        "mean OOMs",
        "worst OOMs",
        "worst OOMs - dbl",
        "t over dbl + 2",
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"limit {limit}: thresholds log-uniform on 1..{limit}; real steps counted (autobatch: "
        f"warm-up and second step included); issue 39's bar {(limit - 1).bit_length() + 3}, "
        f"autobatch's stated worst case {trial_budget(limit) + 2}"
    ]
    for row in [header, *rows]:
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    if not dp:
        lines.append("(bounds not computed: the DP is cubic in the limit; --dp-max takes <= 1024)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limits",
        type=int,
        nargs="+",
        default=[256, 4096, 20_000],
        help="largest sizes (default 256 4096 20000)",
    )
    parser.add_argument(
        "--dp-max",
        type=int,
        default=256,
        help="largest limit the bounds are computed for (default 256; 512 takes a minute)",
    )
    args = parser.parse_args()
    for limit in args.limits:
        if not 4 <= limit <= 1 << 16:
            parser.error(f"--limits {limit} must be in 4..65536")
    if not 4 <= args.dp_max <= 1024:
        parser.error(f"--dp-max {args.dp_max} must be in 4..1024 (the DP is cubic in it)")
    for limit in args.limits:
        print(table(limit, dp=limit <= args.dp_max))
        print("\n".join(goal_lines(limit)))
        print()


if __name__ == "__main__":
    main()
