"""Cost of one ``autobatch.plan(...)`` call: this tree beside a git revision, in one run.

The call is the one ``POST /v1/plan`` makes for ``bench/service_load.py``'s body (a plain max
micro-batch of 24, effective batch 1024 on 8 ranks, the route's options), timed with ``timeit``
in CPU time (on a shared machine, the time a process waits for a core is not counted):
microseconds per call, the minimum over repeats. Each side runs in a child process of its own,
importing ``autobatch`` from this tree (``now``) or from the revision extracted to a temporary
folder (``before``, default the planner before ``PlanConstraints``: the positional
``_resolve``, ``SplitRules``). The two alternate, round by round, so a shift in the machine's
speed hits both alike; the ratio is the median of the rounds' paired ratios ``now / before``.

What it decides: whether the plain form (keyword options, frozen ``Limit`` and ``SplitRules``)
costs anything beside positional options and mutable objects kept "for microseconds". Where a
change costs under about 1 µs per call, on a route that costs about 100 µs, the plain
(keyword, frozen) version stays; ``--before`` a commit that makes one such change alone
measures it.

Usage::

    .venv/bin/python bench/plan_call.py [--before REV] [--rounds N] [--number N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "65d64e5"
"""The last commit with the positional 10-argument ``_resolve`` and ``SplitRules``."""
REPEATS = 40


def child(number: int) -> None:
    """Print the microseconds of one ``plan()`` call (minimum over repeats) and where it ran."""
    import autobatch

    options = {
        "multiple_of": 1,
        "max_gradient_accumulation_steps": None,
        "uneven": "auto",
        "allow_inexact": False,
    }

    def call() -> None:  # the flat plan() for a plain max micro-batch
        autobatch.plan(24, effective_batch_size=1024, world_size=8, source=None, **options)

    timings = timeit.repeat(call, timer=time.process_time, number=number, repeat=REPEATS)
    seconds = min(timings) / number
    print(f"{seconds * 1e6:.4f} {autobatch.__file__}")


def measure(package_root: Path, number: int) -> float:
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--number", str(number)],
        env={**os.environ, "PYTHONPATH": str(package_root)},
        capture_output=True,
        text=True,
        check=True,
    )
    microseconds, where = done.stdout.split()
    assert Path(where).resolve().is_relative_to(package_root.resolve()), where
    return float(microseconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help=f"git revision (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--number", type=int, default=2_000, help="calls per repeat")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.number)
        return
    with tempfile.TemporaryDirectory() as folder:
        old = Path(folder)
        archive = subprocess.run(
            ["git", "archive", args.before, "autobatch"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        before, now = [], []
        for _ in range(args.rounds):
            before.append(measure(old, args.number))
            now.append(measure(ROOT, args.number))
    print(
        f"plan() per call, µs of CPU time (min of {REPEATS} x {args.number} calls, "
        f"{args.rounds} rounds)"
    )
    print(f"{'round':>5} {'before':>9} {'now':>9} {'now/before':>11}")
    for i, (b, n) in enumerate(zip(before, now, strict=True), 1):
        print(f"{i:>5} {b:>9.3f} {n:>9.3f} {n / b:>11.3f}")
    ratios = [n / b for b, n in zip(before, now, strict=True)]
    print(
        f"best: before {min(before):.3f} µs ({args.before}), now {min(now):.3f} µs; "
        f"median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
        f"{max(ratios):.3f}); difference {min(now) - min(before):+.3f} µs per call"
    )


if __name__ == "__main__":
    main()
