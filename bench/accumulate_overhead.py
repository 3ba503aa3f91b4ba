"""Overhead of autobatch.training._accumulator.Accumulator against a hand-written accumulation loop.

Every variant trains the same model and optimizer on the same micro-batches, in one process. Each
repetition times a few optimizer steps of each variant back to back, rotating the order, and
the statistic is the median over repetitions of the *paired* ratio (variant / hand in the same
repetition), so that drift of the machine's speed cancels. A second copy of the hand-written
loop is timed the same way (the A/A control): its ratio shows the noise floor.

Time is the main thread's CPU time (``time.thread_time``) with one intra-op thread
(``--threads 1``, the default), so that time the OS gives to other processes is not counted (on
the 2-core development machine the paired ratios' interquartile range was 6-11% with 2 threads
and wall time, 5% with this). ``--threads N`` times wall clock with N threads instead. Each
ratio is printed with a 95% bootstrap interval of its median; the target counts as met when the
whole interval lies below it.

Workloads:

- ``tiny``: a width-8 MLP on 2 samples, where a step is almost all framework overhead, so the
  difference is the helper's fixed cost per optimizer step in microseconds;
- ``mlp``: a width-256 MLP on 64 samples (about 6.5 ms per optimizer step on one CPU thread);
- ``gpt2``: a 2-layer GPT-2 (``transformers``, random weights) on 8 x 64 synthetic tokens
  (about 200 ms per optimizer step).

Target: the helper adds < 2% to an optimizer step's time (the ``mlp`` and ``gpt2`` ratios).

``Window.run`` is timed too, with ``on_oom="raise"`` and ``on_oom="split"`` (nothing runs out of
memory here), and the ``split / raise`` paired ratio is the cost of being ready to split
(the target: < 2%).

Usage::

    .venv/bin/python bench/accumulate_overhead.py [--workloads tiny,mlp,gpt2] [--repetitions N]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autobatch.training import Accumulator, OnOom

GRADIENT_ACCUMULATION_STEPS = 4
MAX_GRAD_NORM = 1.0
TARGET_RATIO = 1.02  # the goal: the helper adds < 2% to an optimizer step's time


@dataclass(frozen=True)
class Workload:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: list[Any]
    loss_of: Callable[[nn.Module, Any], torch.Tensor]
    repetitions: int
    windows: int


def _mlp(width: int, micro_batch_size: int, windows: int, repetitions: int, name: str) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
    )
    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(micro_batch_size, width, generator=g),
            torch.randn(micro_batch_size, 1, generator=g),
        )
        for _ in range(windows * GRADIENT_ACCUMULATION_STEPS)
    ]

    def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Workload(name, model, optimizer, data, loss_of, repetitions, windows)


def _gpt2(windows: int, repetitions: int) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=128,
        vocab_size=1000,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, config.vocab_size, (8, 64), generator=g)
        for _ in range(windows * GRADIENT_ACCUMULATION_STEPS)
    ]

    def loss_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, labels=input_ids).loss  # type: ignore[no-any-return]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Workload("gpt2", model, optimizer, data, loss_of, repetitions, windows)


def hand_written(w: Workload) -> None:
    """nanoGPT-style loop: loss / k, clip, step, zero_grad every k micro-batches."""
    k = GRADIENT_ACCUMULATION_STEPS
    for start in range(0, len(w.data), k):
        window = w.data[start : start + k]
        for batch in window:
            (w.loss_of(w.model, batch) / len(window)).backward()
        nn.utils.clip_grad_norm_(w.model.parameters(), MAX_GRAD_NORM)
        w.optimizer.step()
        w.optimizer.zero_grad(set_to_none=True)


def with_helper(w: Workload) -> None:
    acc = Accumulator(
        w.model,
        w.optimizer,
        gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS,
        max_grad_norm=MAX_GRAD_NORM,
    )
    for window in acc.windows(w.data):
        for micro in window:
            with micro.sync_context():
                micro.backward(w.loss_of(w.model, micro.batch))
        window.step()


def with_run(on_oom: OnOom) -> Callable[[Workload], None]:
    """The window runs the passes itself (``Window.run``), ready to split or not."""

    def run(w: Workload) -> None:
        acc = Accumulator(
            w.model,
            w.optimizer,
            gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS,
            max_grad_norm=MAX_GRAD_NORM,
            on_oom=on_oom,
        )
        for window in acc.windows(w.data):
            window.run(lambda batch: w.loss_of(w.model, batch))

    return run


VARIANTS: dict[str, Callable[[Workload], None]] = {
    "hand": hand_written,
    "hand (A/A)": hand_written,
    "Accumulator": with_helper,
    "run raise": with_run("raise"),
    "run split": with_run("split"),
}
# Paired ratios with a target: (variant, baseline).
TARGETS = {("Accumulator", "hand"), ("run split", "run raise")}


def measure(w: Workload, clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds per repetition of each variant, interleaved with alternating order."""
    for run in VARIANTS.values():  # warm-up: allocator, AdamW state, lazy inits
        run(w)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    # Every order in turn, so each variant runs in each position about equally often.
    orders = list(itertools.permutations(VARIANTS))
    for repetition in range(w.repetitions):
        for name in orders[repetition % len(orders)]:
            start = clock()
            VARIANTS[name](w)
            times[name].append(clock() - start)
    return times


def median_with_interval(values: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median of ``values`` and its 95% bootstrap percentile interval (seeded, so repeatable)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return statistics.median(values), low, high


def report(w: Workload, times: dict[str, list[float]]) -> None:
    hand = times["hand"]
    hand_ms = statistics.median(hand) / w.windows * 1e3
    print(
        f"{w.name}: {w.repetitions} interleaved repetitions x {w.windows} optimizer steps, "
        f"k={GRADIENT_ACCUMULATION_STEPS}; hand-written loop {hand_ms:.3f} ms per optimizer step"
    )
    pairs = [(name, "hand") for name in list(VARIANTS)[1:]] + [("run split", "run raise")]
    for name, base in pairs:
        label = name if base == "hand" else f"{name} / {base}"
        ratio, low, high = median_with_interval(
            [t / h for t, h in zip(times[name], times[base], strict=True)]
        )
        extra_us = statistics.median(
            [(t - h) / w.windows * 1e6 for t, h in zip(times[name], times[base], strict=True)]
        )
        verdict = ""
        if (name, base) in TARGETS:
            verdict = "met" if high < TARGET_RATIO else "NOT met" if low >= TARGET_RATIO else "open"
            verdict = f"; target < {(TARGET_RATIO - 1) * 100:.0f}%: {verdict}"
        print(
            f"  {label:12s} paired ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%, 95% interval "
            f"{(low - 1) * 100:+.2f}%..{(high - 1) * 100:+.2f}%), {extra_us:+.1f} us per "
            f"optimizer step{verdict}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", default="tiny,mlp,gpt2")
    parser.add_argument(
        "--repetitions", type=int, default=None, help="per workload (default: 300, 300, 60)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 1 times CPU time, more times wall clock (default 1)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few repetitions of each: a smoke run, not a result"
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    builders: dict[str, Callable[[int], Workload]] = {
        "tiny": lambda reps: _mlp(8, 2, windows=5, repetitions=reps, name="tiny"),
        "mlp": lambda reps: _mlp(256, 64, windows=5, repetitions=reps, name="mlp"),
        "gpt2": lambda reps: _gpt2(windows=2, repetitions=reps),
    }
    defaults = {"tiny": 300, "mlp": 300, "gpt2": 60}
    unknown = sorted(set(names) - set(builders))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {sorted(builders)}")
    clock_name = "main-thread CPU time" if clock is time.thread_time else "wall clock"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), {clock_name}")
    for name in names:
        reps = 6 if args.quick else (args.repetitions or defaults[name])
        workload = builders[name](reps)
        report(workload, measure(workload, clock))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
