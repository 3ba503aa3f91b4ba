"""Modern training stacks for ``bench/gpu_check.py``: a torch.compile'd model and an FSDP2
(``fully_shard``) model, probed on the check's device.

- **compiled**: the eager model's probe, then ``torch.compile(model)``'s (inductor on a GPU, the
  cheap ``"eager"`` backend in a dry run), counting Dynamo frames with
  ``torch._dynamo.testing.CompileCounterWithBackend``: how many graphs the probe compiled (one
  for size 1 and one dynamic graph for the rest, not one per size), whether the compiled model
  and a model compiled afterwards still compile, and the profile's ``compiled`` field
  (``"measured"`` on CUDA, ``"confirmed"`` on a simulated device).
- **fsdp2**: a one-rank process group (nccl on a GPU, gloo in a dry run; one GPU allows one
  rank), ``fully_shard`` on each block and the root, ``autotune``, then three training steps at
  the planned micro-batch.

Example::

    rows = [check_compiled(make_device, backend="inductor"), check_fsdp2(make_device)]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from autobatch import autotune, probe
from autobatch.device import Device

__all__ = ["check_compiled", "check_fsdp2", "format_stacks"]


def _blocks_model(width: int, depth: int, device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )
        for _ in range(depth)
    ]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10)).to(device)


def _sample(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, width, device=device), torch.randint(0, 10, (8,), device=device)


def check_compiled(
    make_device: Callable[[], Device], *, backend: str, width: int, depth: int
) -> dict[str, Any]:
    """Probe the eager and the compiled model on the same device; count Dynamo frames."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    device = make_device()
    eager_model = _blocks_model(width, depth, device.torch_device)
    sample = _sample(width, device.torch_device)
    started = time.perf_counter()
    eager = probe(eager_model, sample, loss_fn=F.cross_entropy, device=device)
    eager_seconds = time.perf_counter() - started
    counter = CompileCounterWithBackend(backend)
    compiled_model = torch.compile(
        _blocks_model(width, depth, device.torch_device), backend=counter
    )
    started = time.perf_counter()
    compiled = probe(compiled_model, sample, loss_fn=F.cross_entropy, device=make_device())
    compiled_seconds = time.perf_counter() - started
    frames_in_probe = counter.frame_count
    compiled_model(sample[0][:3])  # a new shape: the compiled model must still compile or reuse
    later = CompileCounterWithBackend(backend)
    torch.compile(_blocks_model(width, 1, device.torch_device), backend=later)(sample[0])
    return {
        "case": f"compiled ({backend})",
        "eager_max_micro_batch_size": eager.max_micro_batch_size,
        "compiled_max_micro_batch_size": compiled.max_micro_batch_size,
        "compiled": compiled.compiled,
        "num_trials": compiled.num_trials,
        "frames_in_probe": frames_in_probe,
        "frames_after_probe": counter.frame_count - frames_in_probe,
        "frames_of_a_later_model": later.frame_count,
        "eager_seconds": eager_seconds,
        "compiled_seconds": compiled_seconds,
        "ok": compiled.compiled != "" and later.frame_count > 0,
    }


def check_fsdp2(make_device: Callable[[], Device], *, width: int, depth: int) -> dict[str, Any]:
    """autotune of an FSDP2 model on a one-rank group, then three training steps."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    device = make_device()
    on_cuda = device.torch_device.type == "cuda"
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device.torch_device if on_cuda else None,
    )
    try:
        model = _blocks_model(width, depth, device.torch_device)
        for block in list(model)[:-1]:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sample = _sample(width, device.torch_device)
        started = time.perf_counter()
        plan = autotune(
            model,
            sample,
            effective_batch_size=4096,
            optimizer=optimizer,
            loss_fn=F.cross_entropy,
            device=device,
            use_store=False,
        )
        seconds = time.perf_counter() - started
        losses = []
        for _ in range(3):
            inputs = sample[0].repeat(-(-plan.micro_batch_size // 8), 1)[: plan.micro_batch_size]
            targets = sample[1].repeat(-(-plan.micro_batch_size // 8))[: plan.micro_batch_size]
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return {
            "case": "fsdp2 (1 rank)",
            "micro_batch_size": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.gradient_accumulation_steps,
            "probe_seconds": seconds,
            "losses": losses,
            "ok": all(loss == loss for loss in losses),  # finite: trains after the probe
        }
    finally:
        dist.destroy_process_group()


def format_stacks(rows: list[dict[str, Any]]) -> str:
    """One line per stack check."""
    lines = []
    for row in rows:
        fields = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("case", "ok"))
        lines.append(f"{row['case']:<22} {'ok' if row.get('ok') else 'FAILED':<6} {fields}")
    return "\n".join(lines)
