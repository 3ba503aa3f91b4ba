"""``bench/search_bounds.py``: its Lightning model matches what the real finder did on the bench's
pattern, and its dynamic programme is a true lower bound (no search that keeps the budget does
better, autobatch's included) with a value that can be worked by hand."""

from __future__ import annotations

import math

import pytest

from autobatch.probing import trial_budget
from bench.search_bounds import (
    autobatch_search,
    best_mean_failures,
    lightning_binsearch,
    weighted,
)


def test_the_lightning_model_takes_what_lightning_took_on_oom_above_37() -> None:
    # probe_vs_peers' oom-above-37 (limit 20000): 2..32 fit, 64, 48, 40 fail, 36, 38, 37
    assert lightning_binsearch(37, 20_000) == (11, 4)
    assert lightning_binsearch(1, 20_000) == (1, 1)  # 2 fails, and 1 is known from the warm-up


def test_the_bound_by_hand_for_two_sizes() -> None:
    # t is 1 or 2 (weights log 2 and log 3/2); one trial at 2 fails only when t is 1.
    assert best_mean_failures(2, 1, limit_failed=False) == pytest.approx(math.log(2) / math.log(3))
    assert best_mean_failures(2, 0, limit_failed=False) == math.inf  # 2 unknown


@pytest.mark.parametrize("limit", [16, 64])
def test_no_search_within_the_budget_beats_the_bound(limit: int) -> None:
    budget = trial_budget(limit)
    _, contradicted, worst, _ = weighted(autobatch_search(estimate=True), limit)
    assert worst <= budget
    assert 1 + best_mean_failures(limit, budget - 1, limit_failed=True) <= contradicted + 1e-9
    _, scratch, worst, _ = weighted(autobatch_search(estimate=False), limit)
    assert worst <= budget
    assert best_mean_failures(limit, budget, limit_failed=False) <= scratch + 1e-9
    # more trials never cost more failures
    assert best_mean_failures(limit, budget + 2, limit_failed=False) <= best_mean_failures(
        limit, budget, limit_failed=False
    )
