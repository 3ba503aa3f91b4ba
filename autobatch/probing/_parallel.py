"""How the probe runs a step under the model's parallel layout, so that no rank is ever left
waiting in a collective while another has stopped (docs/training-loop.md, "Probing under
torch.compile, FSDP, DDP and tensor parallelism"), and
every rank's module can run the next trial after a step that stopped in the middle.

- **Any layout**: each step a trial runs sends every process group's collectives (the
  ``train_step``'s own too, FSDP's, a DTensor's redistributes) to a fake backend, and the
  agreement after it the real ones
  (:func:`autobatch.distributed._fake_backend.process_groups_faked`, entered by the trials),
  so a rank out of memory in the middle of a step leaves no other waiting in one.
- **FSDP2** (``fully_shard``): its all-gathers and reduce-scatters are among those collectives,
  on any device; after a step that stopped in the middle, ``reset_iter_state()`` reshards it and
  clears its per-step state.
- **Tensor parallel** (DTensor parameters) **and 2-D FSDP2 + tensor parallel**: probed as FSDP2
  is, on every device (:data:`RECOVERABLE_LAYOUTS`). Tensor parallelism keeps no state between
  steps (``parallelize_module``'s hooks only redistribute inputs and outputs), and the FSDP2
  part is reset as above.
- **FSDP1** (``FullyShardedDataParallel``): on a device whose allocator raises in the middle of a
  step (CUDA, CPU) several ranks are refused, naming the alternatives: a backward stopped in the
  middle leaves its per-step state behind (the root's queued post-backward callback, flat
  parameters unsharded and marked ``BACKWARD_PRE``), torch has no call that resets it, and on 2
  gloo ranks with torch 2.13 a later step's gradients came out wrong. On a simulated card the
  step runs to its end and the out-of-memory error comes after it.
- **DDP**: the trials run under ``no_sync()`` (no gradient all-reduce inside a trial).
- **CUDA**: the probed GPU is the current device while the trials run (restored after).

Example::

    target = device_for_layout(target, collective_layout(model), world_size=2)
    with trial_context(model, layout, device=target.torch_device, world_size=2, notes=notes):
        ...  # the trials
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch

from autobatch.device import Device, SimulatedDevice
from autobatch.distributed import (
    FSDP2_LAYOUT,
    FSDP2_TP_LAYOUT,
    TENSOR_PARALLEL_LAYOUT,
)
from autobatch.errors import ConfigError

__all__ = [
    "FAKED_NOTE",
    "RECOVERABLE_LAYOUTS",
    "device_for_layout",
    "on_cuda_device",
    "trial_context",
]

FAKED_NOTE = (
    "the steps ran with every process group's collectives (the train_step's own too, e.g. a "
    "logged loss's all-reduce or clip_grad_norm_'s) on a fake backend: no communication, each "
    "rank's own values, so no rank waited for another; the ranks agreed after each step on the "
    "real groups"
)
"""The note a multi-rank probe's profile carries: how its steps' collectives ran."""

RECOVERABLE_LAYOUTS = (FSDP2_LAYOUT, FSDP2_TP_LAYOUT, TENSOR_PARALLEL_LAYOUT)
"""Layouts whose module runs the next step after one that raised in the middle (mid-forward or
mid-backward), once the probe has cleaned up (FSDP2: ``reset_iter_state()``); on several ranks of
a device that raises mid-step they are probed with every process group faked in the step."""


def device_for_layout(device: Device, layout: str, *, world_size: int | None) -> Device:
    """The device to probe a model whose step runs collectives on; refuses a layout whose
    module a step stopped in the middle on one rank would leave unable to run the next trial.

    Args:
        device: the device asked for.
        layout: :func:`autobatch.distributed._layout.collective_layout`'s name (not empty).
        world_size: the ranks probing together; None when the probe has no consensus.

    Raises:
        ConfigError: several ranks without a consensus, or several ranks of FSDP1 on a device
            whose allocator raises out-of-memory errors in the middle of a step (CUDA, CPU):
            FSDP1's per-step state cannot be reset after such a step (names the alternatives).
    """
    import torch.distributed as dist

    if world_size is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                f"the model is sharded with {layout} over {dist.get_world_size()} ranks, but "
                "probe() got no consensus, so the ranks would probe apart and one that runs out "
                "of memory would leave the others in a collective; call autobatch.autotune, or "
                "pass consensus=autobatch.ProcessGroupConsensus() on every rank"
            )
        return device
    if world_size == 1 or layout in RECOVERABLE_LAYOUTS:
        return device
    if isinstance(device, SimulatedDevice):  # FSDP1: the step runs to its end
        return device.deferring_oom()
    raise ConfigError(
        f"cannot probe a model sharded with {layout} on {world_size} ranks of "
        f"{device.type} ({device.name}): its allocator raises out-of-memory errors in the middle "
        "of a step, and an FSDP1 backward stopped in the middle leaves FSDP's per-step state "
        "behind (the root's queued post-backward callback, flat parameters left unsharded), "
        "which torch has no call to reset, so the next trial's gradients and memory would be "
        "wrong. Shard with FSDP2 (fully_shard) instead, whose state the probe resets after such "
        "a step (reset_iter_state), or probe the same layout on simulated devices of each "
        "card's capacity (device='sim:80GiB': the step runs on the CPU, an out-of-memory error "
        "is raised once the step ends), or probe on a single rank (world size 1), or plan from "
        "a micro-batch size you know with autobatch.plan(...)"
    )


def trial_context(
    model: torch.nn.Module,
    layout: str,
    *,
    device: torch.device,
    world_size: int,
    notes: list[str],
) -> ExitStack:
    """Everything the trials run inside for this layout and device; appends what it did to
    ``notes`` (the profile's)."""
    stack = ExitStack()
    stack.enter_context(on_cuda_device(device))
    stack.enter_context(_no_gradient_sync(model, notes))
    if layout == FSDP2_LAYOUT and world_size > 1:
        notes.append(
            "FSDP2: trials ran FSDP's all-gathers and reduce-scatters on a fake process group "
            "(no communication, the same allocations), so no rank waited for another; the ranks "
            "agreed after each step"
        )  # process_groups_faked's per-step fake backends (trials.py) carry FSDP's collectives
    return stack


def on_cuda_device(device: torch.device) -> AbstractContextManager[object]:
    """Make a probed CUDA device the current one during the trials, and restore the previous one
    after: a step that allocates on "the current device" (``.cuda()``, NCCL's first collective)
    must not reach cuda:0, another rank's GPU, on a rank that never called set_device."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return nullcontext()


def _no_gradient_sync(model: torch.nn.Module, notes: list[str]) -> AbstractContextManager[object]:
    """``model.no_sync()`` for a ``DistributedDataParallel`` model (noted), else nothing.

    DDP all-reduces gradients inside backward: a rank that ran out of memory earlier in the
    step would leave the others waiting in that all-reduce. Without it, the ranks' next
    collective is the probe's own agreement after the step, which every rank reaches. The
    gradient buckets are allocated when DDP wraps the model, so CUDA's statistics count them.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return nullcontext()
    notes.append(
        "DistributedDataParallel: trials ran under no_sync() (no gradient all-reduce inside a "
        "trial, so no rank waits in one while another is out of memory)"
    )
    return model.no_sync()
