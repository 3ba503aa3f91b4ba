"""FSDP2's collectives without communication, for the length of a probe's trials.

A step of a ``fully_shard`` model all-gathers parameters and reduce-scatters gradients. A rank
that runs out of memory between two of those collectives would leave the other ranks waiting in
the next one until the process group's timeout. Inside :func:`fsdp2_collectives_faked` every
FSDP2 parameter group sends its all-gathers and reduce-scatters to a ``FakeProcessGroup`` of the
same rank and size (torch's "fake" backend: it allocates nothing of its own and returns at once),
so each rank's step runs alone, allocating exactly what it would (FSDP allocates the collectives'
outputs itself); the ranks then agree once per trial through the real group. The gathered values
are garbage, which does not matter to memory, and the probe restores parameters, gradients and
optimizer state afterwards. On exit the real groups are put back.

This reaches into FSDP2's private state (``FSDPParamGroup.mesh_info``); the 2-rank tests in
``tests/unit/test_fsdp.py`` pin it. Collectives outside FSDP's own (a gradient-norm all-reduce
inside a user's ``train_step``) still use the real group.

Example::

    with fsdp2_collectives_faked(model) as num_groups:
        step.run(batch)          # no rank waits for another
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["fsdp2_collectives_faked", "reset_fsdp2"]

_GROUP_FIELDS = ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group")
"""The process groups an FSDP2 mesh info holds (FSDP, a separate reduce-scatter group, HSDP)."""


@contextmanager
def fsdp2_collectives_faked(model: torch.nn.Module) -> Iterator[int]:
    """Inside the block, FSDP2's collectives in ``model`` go to fake groups; yields how many
    process groups were swapped (0 when the model has no FSDP2 module)."""
    from torch.distributed.fsdp import FSDPModule

    swapped: list[tuple[Any, str, dist.ProcessGroup]] = []
    fakes: dict[int, dist.ProcessGroup] = {}
    try:
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            for info in _mesh_infos(module):
                for field in _GROUP_FIELDS:
                    real = getattr(info, field, None)
                    if real is None:
                        continue
                    if id(real) not in fakes:
                        fakes[id(real)] = _fake_like(real)
                    swapped.append((info, field, real))
                    setattr(info, field, fakes[id(real)])
        yield len(fakes)
    finally:
        for info, field, real in reversed(swapped):
            setattr(info, field, real)


def reset_fsdp2(model: torch.nn.Module) -> None:
    """After a step that raised mid-forward or mid-backward: FSDP2's own recovery,
    ``reset_iter_state()`` on the root ``fully_shard`` module (the first in ``model.modules()``):
    it reshards every parameter group and clears the step's trackers, so the next step runs."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reset_iter_state()
            return


def _mesh_infos(module: Any) -> list[Any]:
    """The mesh infos (each once) of a ``fully_shard`` module's parameter groups."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    infos: dict[int, Any] = {}
    for group in groups:
        if group is None:
            continue
        for info in (group.mesh_info, getattr(group, "post_forward_mesh_info", None)):
            if info is not None:
                infos.setdefault(id(info), info)
    return list(infos.values())


def _fake_like(real: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group of ``real``'s rank and size whose collectives do nothing."""
    from torch._C._distributed_c10d import FakeProcessGroup, HashStore, ProcessGroup

    rank, size = real.rank(), real.size()
    fake = ProcessGroup(HashStore(), rank, size)
    backend = FakeProcessGroup._create_internal(rank, size)
    for device_type in ("cpu", "cuda"):
        fake._register_backend(torch.device(device_type), ProcessGroup.BackendType.CUSTOM, backend)
    return fake
