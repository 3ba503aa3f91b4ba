"""autobatch's probe beside PyTorch Lightning's BatchSizeFinder (binsearch) and Hugging Face
Accelerate's ``find_executable_batch_size``, on the same simulated device, in one run.

For each tiny model (MLP, CNN with BatchNorm, GPT-2, BERT, ViT; transformers configs with random
weights) at two capacities of :class:`autobatch.SimulatedDevice` (the real step on the CPU,
``torch.OutOfMemoryError`` when live tensor bytes exceed the capacity), every tool searches for the
largest micro-batch on a fresh copy of the model; the exhaustive max (every size from 1 up, one scan
per model at its larger capacity, the smaller capacity's max read off the measured peaks) is the
reference. How each peer is wired (and the one message translation Lightning needs) is in
``bench/_peers.py``.

Accelerate starts at twice the exhaustive max by default (``--accelerate-start 2x``): generous to
it, since a user does not know the max; ``--accelerate-start 128`` uses its own default.

Targets (the issue): autobatch's median real trials <= 4 and OOMs <= 1, found >= 98% of the
exhaustive max, and >= 5x fewer training steps than Lightning's binsearch.

Usage::

    .venv/bin/python bench/probe_vs_peers.py            # 5 models x 2 capacities
    .venv/bin/python bench/probe_vs_peers.py --quick    # 1 model x 1 capacity
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from autobatch import SimulatedDevice
from bench._peers import (
    TINY_CASES,
    ToolResult,
    exhaustive_at,
    format_capacity,
    format_summary,
    format_table,
    median,
    run_accelerate,
    run_autobatch,
    run_exhaustive,
    run_lightning,
    summarize,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one model, one capacity")
    parser.add_argument(
        "--models", nargs="*", default=None, help="case names (default: all tiny cases)"
    )
    parser.add_argument(
        "--accelerate-start",
        default="2x",
        help="accelerate's starting size: '2x' (twice the exhaustive max) or an int (default 2x)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    return parser.parse_args(argv)


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """(target, met, measured) for each of the issue's targets."""
    summary = summarize(rows)["autobatch"]
    step_ratios = [
        row["lightning"].num_steps / row["autobatch"].num_steps
        for row in rows
        if row.get("lightning") is not None
    ]
    return [
        (
            "median real trials <= 4",
            summary["median_trials"] <= 4,
            f"{summary['median_trials']:g}",
        ),
        ("median OOMs <= 1", summary["median_ooms"] <= 1, f"{summary['median_ooms']:g}"),
        (
            "found >= 98% of exhaustive max (every case)",
            summary["min_ratio"] >= 0.98,
            f"median {summary['median_ratio']:.3f}, min {summary['min_ratio']:.3f}",
        ),
        (
            ">= 5x fewer steps than Lightning binsearch (median of per-case ratios)",
            median(step_ratios) >= 5,
            f"median {median(step_ratios):.1f}x, min {min(step_ratios, default=float('nan')):.1f}x",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [c for c in TINY_CASES if args.models is None or c.name in args.models]
    if not cases:
        print(
            f"no case named {args.models}; known: {[c.name for c in TINY_CASES]}", file=sys.stderr
        )
        return 2
    plan = [(case, capacity) for case in cases for capacity in case.capacities_bytes]
    if args.quick:
        plan = plan[:1]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    scans: dict[str, ToolResult] = {}
    for case, capacity in plan:
        print(f"{case.name} @ {format_capacity(capacity)} ...", file=sys.stderr, flush=True)
        if case.name not in scans:  # one scan per case, at its largest capacity in the plan
            largest = max(c for other, c in plan if other.name == case.name)
            scans[case.name] = run_exhaustive(case, SimulatedDevice(capacity_bytes=largest))
        reference = exhaustive_at(scans[case.name], capacity)
        device = SimulatedDevice(capacity_bytes=capacity)
        ours, _ = run_autobatch(case, device)
        assert device.num_ooms == ours.num_ooms, (device.num_ooms, ours.num_ooms)
        device = SimulatedDevice(capacity_bytes=capacity)
        lightning = run_lightning(case, device, accelerator="cpu")
        assert device.num_ooms == lightning.num_ooms, (device.num_ooms, lightning.num_ooms)
        start = (
            2 * max(reference.micro_batch_size, 1)
            if args.accelerate_start == "2x"
            else int(args.accelerate_start)
        )
        device = SimulatedDevice(capacity_bytes=capacity)
        accelerate = run_accelerate(case, device, starting_micro_batch_size=start)
        assert device.num_ooms == accelerate.num_ooms, (device.num_ooms, accelerate.num_ooms)
        rows.append(
            {
                "case": case.name,
                "capacity_bytes": capacity,
                "exhaustive": reference,
                "autobatch": ours,
                "lightning": lightning,
                "accelerate": accelerate,
            }
        )
    print()
    print(
        "Simulated device (real step on CPU, OOM over the capacity); found = largest micro-batch "
        "reported; ratio = found / exhaustive max; trials = sizes tried (warm-up included); "
        "steps = training steps run (OOMs included)."
    )
    print(format_table(rows))
    print()
    print(format_summary(summarize(rows)))
    for name, met, measured in targets(rows):
        print(f"target {'MET   ' if met else 'MISSED'} {name}: {measured}")
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
