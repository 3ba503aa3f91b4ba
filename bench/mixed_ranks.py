"""Ranks on mixed cards: the time per optimizer step of autobatch's mixed plan beside the
smallest-card (uniform) plan and the best split found by brute force, all pure, in one run.

Two simulated cards run one model: an 80 GiB card that is also faster, and a 40 GiB card. The
model's step needs ``16 GiB + 1.25 GiB x micro_batch_size`` (weights, gradients, Adam state,
then activations) and each card keeps 5% free, so the largest micro-batch is 48 on the 80 GiB
card and 17 on the 40 GiB one; a step takes ``0.030 s + 0.0040 s x m`` on the first and
``0.050 s + 0.0065 s x m`` on the second. Ranks run their ``k`` micro-steps side by side and
meet at the gradient all-reduce, so an optimizer step takes ``k x`` the slowest rank's step
(communication aside, the same in all three). Rows, per mix of cards and effective batch:

- ``mixed``: :func:`autobatch.planning.plan_mixed_ranks` with each rank's max and step line.
- ``brute force``: every ``k`` dividing the effective batch and every split of ``E / k`` into
  per-rank micro-batches within their maxima, the least time per optimizer step.
- ``uniform``: what a job gets today, :func:`autobatch.planning.plan` at the smallest card's max
  on every rank (micro-batches that differ by 1 across steps when it must), given the slowest
  card's step times so that it too may take more, faster steps.

Usage::

    .venv/bin/python bench/mixed_ranks.py            # 2 and 4 ranks, effective batches to 512
    .venv/bin/python bench/mixed_ranks.py --quick    # 2 and 4 ranks, small batches (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from collections.abc import Sequence

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autobatch.planning import PlanRequest, RankLimit, StepLine, plan_mixed_ranks, plan_request

GiB = 2**30
_FIXED_BYTES, _BYTES_PER_SAMPLE, _MARGIN = 16 * GiB, 5 * GiB // 4, 0.05


@dataclasses.dataclass(frozen=True)
class Card:
    """A simulated card: its memory and its step time."""

    name: str
    total_memory_bytes: int
    line: StepLine

    @property
    def max_micro_batch_size(self) -> int:
        """The largest micro-batch whose step fits with the margin kept free."""
        usable = int(self.total_memory_bytes * (1 - _MARGIN))
        return (usable - _FIXED_BYTES) // _BYTES_PER_SAMPLE


BIG = Card("80GiB", 80 * GiB, StepLine(fixed_seconds=0.030, per_sample_seconds=0.0040))
SMALL = Card("40GiB", 40 * GiB, StepLine(fixed_seconds=0.050, per_sample_seconds=0.0065))
MIXES = {
    "1x80+1x40": (BIG, SMALL),
    "2x80+2x40": (BIG, BIG, SMALL, SMALL),
    "1x80+3x40": (BIG, SMALL, SMALL, SMALL),
}
FULL_BATCHES = (64, 96, 128, 200, 256, 384, 512)
QUICK_BATCHES = (24, 64, 96)


@dataclasses.dataclass(frozen=True)
class Row:
    """One mix and effective batch: each plan's accumulation steps, micro-batches and time."""

    mix: str
    effective_batch_size: int
    mixed: tuple[int, tuple[int, ...], float]
    brute: tuple[int, tuple[int, ...], float]
    uniform: tuple[int, tuple[int, ...], float]


def step_seconds(cards: Sequence[Card], steps: int, sizes: Sequence[int]) -> float:
    """Seconds per optimizer step: ``steps`` micro-steps, each as long as the slowest rank's."""
    return steps * max(card.line.seconds(size) for card, size in zip(cards, sizes, strict=True))


def brute_force(cards: Sequence[Card], effective: int) -> tuple[int, tuple[int, ...], float]:
    """The least time per optimizer step over every ``k`` and every per-rank split."""
    maxima = [card.max_micro_batch_size for card in cards]
    best: tuple[int, tuple[int, ...], float] | None = None
    for steps in range(1, effective + 1):
        if effective % steps:
            continue
        per_step = effective // steps
        for head in itertools.product(*(range(1, m + 1) for m in maxima[:-1])):
            last = per_step - sum(head)
            if not 1 <= last <= maxima[-1]:
                continue
            sizes = (*head, last)
            seconds = step_seconds(cards, steps, sizes)
            if best is None or seconds < best[2]:
                best = (steps, sizes, seconds)
    assert best is not None, f"no split of {effective} on {len(cards)} ranks"
    return best


def compare(mix: str, cards: Sequence[Card], effective: int) -> Row:
    """The three plans for ``cards`` and ``effective``, each with its time per optimizer step."""
    ranks = [
        RankLimit(max_micro_batch_size=card.max_micro_batch_size, step_line=card.line)
        for card in cards
    ]
    plans = plan_mixed_ranks(
        ranks, PlanRequest(effective_batch_size=effective, world_size=len(cards))
    )
    steps, sizes = plans[0].gradient_accumulation_steps, plans[0].rank_micro_batch_sizes or ()
    smallest = min(card.max_micro_batch_size for card in cards)
    # Every micro-step takes the slowest card's time, given as exact step times: the uniform
    # planner then takes more steps when they are faster, as the mixed one does.
    slowest = {m: max(card.line.seconds(m) for card in cards) for m in range(1, smallest + 1)}
    uniform = plan_request(
        smallest,
        PlanRequest(effective_batch_size=effective, world_size=len(cards), step_seconds=slowest),
    )
    uniform_seconds = sum(
        step_seconds(cards, 1, [size] * len(cards)) for size in uniform.micro_batch_sizes
    )
    return Row(
        mix=mix,
        effective_batch_size=effective,
        mixed=(steps, sizes, step_seconds(cards, steps, sizes)),
        brute=brute_force(cards, effective),
        uniform=(
            uniform.gradient_accumulation_steps,
            uniform.micro_batch_sizes,
            uniform_seconds,
        ),
    )


def rows(batches: Sequence[int]) -> list[Row]:
    """Every mix at every effective batch in ``batches``."""
    return [compare(mix, cards, effective) for mix, cards in MIXES.items() for effective in batches]


def _shown(plan_row: tuple[int, tuple[int, ...], float], *, per_rank: bool) -> str:
    """``k x (each rank's micro-batch) seconds``, or for the uniform plan ``k x m`` (``m|m-1``
    when its steps differ by one)."""
    steps, sizes, seconds = plan_row
    if per_rank:
        shown = "(" + "/".join(str(s) for s in sizes) + ")"
    else:
        shown = "|".join(str(s) for s in sorted(set(sizes), reverse=True))
    return f"{steps} x {shown} {seconds:.3f} s"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small effective batches")
    quick = parser.parse_args(argv).quick
    table = rows(QUICK_BATCHES if quick else FULL_BATCHES)
    print(
        "cards: "
        + ", ".join(
            f"{c.name} max micro-batch {c.max_micro_batch_size}, step "
            f"{c.line.fixed_seconds} s + {c.line.per_sample_seconds} s x m"
            for c in (BIG, SMALL)
        )
    )
    header = (
        "mix",
        "E",
        "mixed",
        "brute force",
        "uniform (smallest card)",
        "mixed/brute",
        "uniform/mixed",
    )
    cells = [header] + [
        (
            row.mix,
            str(row.effective_batch_size),
            _shown(row.mixed, per_rank=True),
            _shown(row.brute, per_rank=True),
            _shown(row.uniform, per_rank=False),
            f"{row.mixed[2] / row.brute[2]:.3f}",
            f"{row.uniform[2] / row.mixed[2]:.3f}",
        )
        for row in table
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    for line in cells:
        print(
            "  ".join(
                c.ljust(w) if i < 5 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    worst = max(row.mixed[2] / row.brute[2] for row in table)
    least = min(row.uniform[2] / row.mixed[2] for row in table)
    print(f"worst mixed/brute {worst:.3f}; least uniform/mixed {least:.3f}")


if __name__ == "__main__":
    main()
