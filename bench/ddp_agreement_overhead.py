"""Cost of the Accumulator's error agreements under DDP: 2 gloo ranks on CPU, side by side.

Since an error on one rank must reach the others (:mod:`autobatch.training._window_agreement`), the
ranks'
count all-reduce of each window carries a status per rank, and the ranks meet once more when the
micro-batches run out (once per loop), and before the synchronised backward of a window where
some rank has a micro-batch counting 0 items (none here). This times, interleaved in one run,
epochs of the Accumulator's manual loop as it is (``agreed``) and as it was (``before``: the
loop left after its last window, so no agreement at the end, and none before the synchronised
backward). The statistic is the median over repetitions of the paired ratio ``agreed /
before`` with a 95% bootstrap interval; target: < 2%.

Wall time on rank 0 (the ranks wait for each other), one intra-op thread per rank. gloo on a
loaded CPU is a pessimistic bound: a tiny NCCL all-reduce costs tens of microseconds against
optimizer steps of tens of milliseconds and more.

Usage::

    .venv/bin/python bench/ddp_agreement_overhead.py [--repetitions N] [--windows N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autobatch.training import Accumulator

WORLD_SIZE = 2
GRADIENT_ACCUMULATION_STEPS = 4
WIDTH = 256
MICRO_BATCH_SIZE = 64
TARGET_RATIO = 1.02


def _epoch(
    acc: Accumulator,
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    agreed: bool,
) -> None:
    last = len(data) // GRADIENT_ACCUMULATION_STEPS - 1
    for window in acc.windows(data):
        if not agreed:  # the baseline: no agreement before the synchronised backward
            window._state.agrees = window._state.sync_due = False
        for micro in window:
            with micro.sync_context():
                x, y = micro.batch
                micro.backward(nn.functional.mse_loss(model(x), y))
        window.step()
        if not agreed and window.index == last:
            break  # the baseline: no agreement when the micro-batches run out


def _worker(rank: int, store: str, repetitions: int, windows: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1)
    )
    model = DistributedDataParallel(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS)
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(MICRO_BATCH_SIZE, WIDTH, generator=g), torch.randn(MICRO_BATCH_SIZE, 1))
        for _ in range(windows * GRADIENT_ACCUMULATION_STEPS)
    ]
    for agreed in (True, False):  # warm-up
        _epoch(acc, model, data, agreed=agreed)
    times: dict[bool, list[float]] = {True: [], False: []}
    for repetition in range(repetitions):
        for agreed in (True, False) if repetition % 2 else (False, True):
            dist.barrier()
            start = time.perf_counter()
            _epoch(acc, model, data, agreed=agreed)
            times[agreed].append(time.perf_counter() - start)
    if rank == 0:
        ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
        rng = random.Random(0)
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        ratio, low, high = statistics.median(ratios), medians[50], medians[1949]
        before_ms = statistics.median(times[False]) / windows * 1e3
        met = "met" if high < TARGET_RATIO else "open"
        print(
            f"{WORLD_SIZE} gloo ranks, MLP width {WIDTH}, {MICRO_BATCH_SIZE} x "
            f"{GRADIENT_ACCUMULATION_STEPS} samples per window and rank, {windows} windows per "
            f"epoch, {repetitions} interleaved repetitions; before: {before_ms:.3f} ms per "
            "optimizer step"
        )
        print(
            f"  agreed / before paired ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%, 95% interval "
            f"{(low - 1) * 100:+.2f}%..{(high - 1) * 100:+.2f}%), "
            f"{(ratio - 1) * before_ms * 1e3:+.1f} us per optimizer step; target < 2%: {met}"
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/helpers/gloo_exit.py: gloo's threads can abort a normal exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=100)
    parser.add_argument("--windows", type=int, default=10, help="windows per epoch")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(os.path.join(tmp, "store"), args.repetitions, args.windows),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
