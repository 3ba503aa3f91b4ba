"""Data-parallel training with a tuned micro-batch: autotune under torchrun, then accumulate.

Every rank probes its own device; the ranks agree, so each gets the same plan (a size fits only
if it fits on every rank). ``world_size`` comes from the process group; rank 0 alone writes the
profile store, and a second launch on the same cards is answered from it without a probe.

Run on 2 GPUs (nccl), or on the CPU with simulated 16 MiB cards (gloo)::

    torchrun --nproc_per_node 2 examples/torchrun_autotune.py --effective-batch-size 4096
    torchrun --nproc_per_node 2 examples/torchrun_autotune.py --device sim:16MiB --steps 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autobatch
from autobatch import Accumulator

EXAMPLE_STORE = os.path.join(tempfile.gettempdir(), "autobatch-examples.sqlite3")
"""Where the example keeps its profiles: its own store, never the user's default one."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--effective-batch-size", type=int, default=4096)
    parser.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK, or sim:16MiB")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to train")
    parser.add_argument(
        "--store",
        default=EXAMPLE_STORE,
        help="profile store path (default: the examples' own, apart from your store)",
    )
    return parser.parse_args(argv)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
    )


def micro_batches(
    sizes: tuple[int, ...], device: torch.device
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Synthetic (inputs, targets) micro-batches of the plan's sizes, window after window (use a
    DataLoader with a DistributedSampler and ``batch_size=plan.micro_batch_size`` in practice)."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    while True:
        for size in sizes:
            inputs = torch.randn(size, 256, generator=generator)
            yield inputs.to(device), torch.randint(0, 10, (size,), generator=generator).to(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and args.device is None
    if use_cuda:
        torch.cuda.set_device(local_rank)  # nccl collectives run on the current device
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        device_spec = args.device or (f"cuda:{local_rank}" if use_cuda else "sim:16MiB")
        torch_device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
        model = build_model().to(torch_device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sample = (
            torch.randn(1, 256, device=torch_device),
            torch.zeros(1, dtype=torch.long, device=torch_device),
        )

        # Probe before wrapping in DDP: the probe's steps must not all-reduce gradients.
        plan = autobatch.autotune(
            model,
            sample,
            effective_batch_size=args.effective_batch_size,
            optimizer=optimizer,
            loss_fn=F.cross_entropy,
            device=device_spec,
            store=args.store,
        )
        if dist.get_rank() == 0:
            print(
                f"world_size {plan.world_size}: micro-batch {plan.micro_batch_size} x "
                f"{plan.gradient_accumulation_steps} accumulation steps "
                f"(sizes {list(plan.micro_batch_sizes)}, from a {plan.source} profile)",
                flush=True,
            )

        ddp = DistributedDataParallel(model)
        accumulator = Accumulator(
            ddp, optimizer, gradient_accumulation_steps=plan.gradient_accumulation_steps
        )
        batches = micro_batches(plan.micro_batch_sizes, torch_device)
        for window in accumulator.windows(batches):
            for micro in window:
                inputs, targets = micro.batch
                with micro.sync_context():  # one all-reduce per window, on its last micro-step
                    micro.backward(F.cross_entropy(ddp(inputs), targets))
            stats = window.step()
            if dist.get_rank() == 0:
                print(f"step {window.index}: loss {float(stats.loss):.4f}", flush=True)
            if window.index + 1 == args.steps:
                break
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
