"""Overhead of autobatch.accumulate.Accumulator against a hand-written accumulation loop.

Both run the same model, data, optimizer and clipping in one process; repetitions are interleaved
(alternating which goes first) and the medians are compared. Target: the helper adds < 2%.

Usage::

    .venv/bin/python bench/accumulate_overhead.py [--repetitions 30] [--windows 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from autobatch.accumulate import Accumulator

Batch = tuple[torch.Tensor, torch.Tensor]


def build(seed: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def hand_written(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[Batch], k: int, max_norm: float
) -> None:
    """nanoGPT-style loop: loss / k, clip, step, zero_grad every k micro-batches."""
    for start in range(0, len(data), k):
        window = data[start : start + k]
        for batch in window:
            (loss_of(model, batch) / len(window)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)


def with_helper(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[Batch], k: int, max_norm: float
) -> None:
    acc = Accumulator(model, opt, gradient_accumulation_steps=k, max_grad_norm=max_norm)
    for window in acc.windows(data):
        for micro in window:
            with micro.sync_context():
                micro.backward(loss_of(model, micro.batch))
        window.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--windows", type=int, default=5, help="optimizer steps per repetition")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)

    k = args.gradient_accumulation_steps
    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(args.micro_batch_size, args.width, generator=g),
            torch.randn(args.micro_batch_size, 1, generator=g),
        )
        for _ in range(args.windows * k)
    ]
    runners: dict[str, Callable[..., None]] = {"hand": hand_written, "helper": with_helper}
    setups = {name: build(0, args.width) for name in runners}
    for name, run in runners.items():  # warm-up: allocator, AdamW state
        run(*setups[name], data, k, 1.0)

    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for _ in range(args.repetitions):
        for name in order:
            start = time.perf_counter()
            runners[name](*setups[name], data, k, 1.0)
            times[name].append(time.perf_counter() - start)
        order.reverse()

    hand = statistics.median(times["hand"]) / args.windows
    helper = statistics.median(times["helper"]) / args.windows
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; MLP width {args.width}, "
        f"micro-batch {args.micro_batch_size}, k={k}, AdamW, clip 1.0; "
        f"{args.repetitions} interleaved repetitions x {args.windows} optimizer steps"
    )
    print(f"hand-written loop: {hand * 1e3:8.3f} ms per optimizer step (median)")
    print(f"Accumulator:       {helper * 1e3:8.3f} ms per optimizer step (median)")
    print(f"ratio helper / hand: {helper / hand:.4f} ({(helper / hand - 1) * 100:+.2f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
