"""How many OOMs a search for the largest micro-batch needs when nothing predicts the failure:
autobatch's search beside a model of Lightning's binsearch and the best search that keeps
autobatch's trial budget, all pure (no model, no device), in one run.

The failure threshold ``t`` (the largest size that fits) is drawn log-uniform on ``1 .. limit``
(``t`` with weight ``log((t + 1) / t)``: a max of 3 is as likely as one of 3,000 on a scale of
decades). Each search gets the outcome of every size it tries (fits when ``size <= t``) and must
end knowing ``t`` exactly. Rows, each the weighted mean (and the worst) over every ``t``:

- ``autobatch, estimate contradicted``: the estimate's peaks say every size fits, so its first
  trial is the limit, which fails (``oom-above-37`` in ``probe_vs_peers.py`` is one such ``t``);
  then autobatch's search from what ran (``autobatch.probing._search.next_micro_batch_size``).
- ``autobatch, no estimate``: the search from the warm-up alone (growth steps, then from what ran).
- ``Lightning binsearch (model)``: ``BatchSizeFinder(mode="binsearch")``'s loop as Lightning 2.x
  writes it (``_run_binary_scaling``: start at 2, double while it fits, then halve the bracket),
  without its ``max_trials`` cap of 25 (no ``t`` here needs that many).
- ``best within budget, after the failed limit``: the least mean OOMs any search can reach once
  the limit has failed, with the trials autobatch's budget has left
  (``trial_budget(limit) - 1``), by dynamic programming over brackets ``(lo, hi)`` and trials left.
- ``best within budget, from scratch``: the same from the warm-up alone (no limit trial).

The last two rows are bounds, not searches: no policy that keeps the budget does better on
average over this prior. They say how much of the gap to Lightning is the estimate's failed limit
trial (which the estimate buys its 4-step, 1-OOM road with on well-behaved models) and how much
is the trial budget (Lightning takes up to ``2 * log2(t)`` trials; the budget is
``ceil(log2(limit)) + 3``).

Usage::

    .venv/bin/python bench/search_bounds.py              # limit 256 (the DP takes a few seconds)
    .venv/bin/python bench/search_bounds.py --limit 512
"""

from __future__ import annotations

import argparse
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
_CAPACITY_BYTES = 10**12

Search = Callable[[int, int], tuple[int, int]]
"""``search(t, limit) -> (trials, failures)``, the warm-up aside."""


def autobatch_search(*, estimate: bool) -> Search:
    """autobatch's search on threshold ``t``; with ``estimate``, the limit is tried first."""

    def run(t: int, limit: int) -> tuple[int, int]:
        points = [Point(micro_batch_size=1, fits=True, warm_up=True)]
        prior = _TINY if estimate else None
        size: int | None = limit if estimate and limit > 1 else None
        if size is None:
            size = next_micro_batch_size(
                points, capacity_bytes=_CAPACITY_BYTES, limit=limit, prior=prior
            )
        while size is not None:
            fits = size <= t
            points.append(
                Point(micro_batch_size=size, fits=fits, peak_bytes=1_000 + size if fits else 0)
            )
            size = next_micro_batch_size(
                points, capacity_bytes=_CAPACITY_BYTES, limit=limit, prior=prior
            )
        assert bracket(points)[0] == t, (t, [p.micro_batch_size for p in points])
        tried = [p for p in points if not p.warm_up]
        return len(tried), sum(not p.fits for p in tried)

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


def weighted(search: Search, limit: int) -> tuple[float, float, int, int]:
    """``(mean trials, mean failures, worst trials, worst failures)`` over ``t`` in 1..limit."""
    total = trials_sum = failures_sum = 0.0
    worst_trials = worst_failures = 0
    for t in range(1, limit + 1):
        weight = math.log((t + 1) / t)
        trials, failures = search(t, limit)
        total += weight
        trials_sum += weight * trials
        failures_sum += weight * failures
        worst_trials = max(worst_trials, trials)
        worst_failures = max(worst_failures, failures)
    return trials_sum / total, failures_sum / total, worst_trials, worst_failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=256, help="largest size (default 256)")
    limit = parser.parse_args().limit
    if not 4 <= limit <= 1024:
        parser.error(f"--limit {limit} must be in 4..1024 (the DP is cubic in it)")
    budget = trial_budget(limit)
    rows: list[tuple[str, str, str, str, str]] = []
    for name, search in (
        ("autobatch, estimate contradicted", autobatch_search(estimate=True)),
        ("autobatch, no estimate", autobatch_search(estimate=False)),
        ("Lightning binsearch (model)", lightning_binsearch),
    ):
        trials, failures, worst_trials, worst_failures = weighted(search, limit)
        rows.append(
            (name, f"{trials:.2f}", str(worst_trials), f"{failures:.2f}", str(worst_failures))
        )
    after = 1.0 + best_mean_failures(limit, budget - 1, limit_failed=True)
    scratch = best_mean_failures(limit, budget, limit_failed=False)
    rows.append(("best within budget, after the failed limit", "", str(budget), f"{after:.2f}", ""))
    rows.append(("best within budget, from scratch", "", str(budget), f"{scratch:.2f}", ""))
    print(
        f"limit {limit}, thresholds log-uniform on 1..{limit}, trial budget {budget} "
        "(warm-up aside)"
    )
    header = ("search", "mean trials", "worst trials", "mean OOMs", "worst OOMs")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )


if __name__ == "__main__":
    main()
