"""Collectives without communication, for the length of a probe's steps.

A rank that runs out of memory before a collective in the step (FSDP2's all-gathers and reduce-
scatters, or the user's own ``train_step``'s: an all-reduce of the loss for logging,
``clip_grad_norm_``'s norm over DTensor gradients) would leave the other ranks in that collective
until the process group's timeout, or pair their collective with its next one (the probe's
agreement), which gloo aborts the process on and NCCL may hang on. :func:`process_groups_faked`
keeps each rank's step alone; the ranks then agree once per trial through the real groups. Around
each step the probe runs, every process group of the process (the default group, ``new_group``'s, a
DeviceMesh's, which ``dist.all_reduce(group=)``, a DTensor redistribute and the functional
collectives reach by object or by name) sends its collectives to a ``FakeProcessGroup`` backend of
the same rank and size (torch's "fake" backend: it allocates nothing of its own and returns at
once). The groups are the same objects, with the same names, so nothing that holds one or looks it
up by name is missed; only their backends are swapped, and on exit, exceptions included, each device
type gets its own backend back. What needs the other ranks (an object another rank sends, creating a
group) is refused instead. FSDP2's all-gathers and reduce-scatters go to the fake backend with the
rest (its parameter groups hold these same group objects); FSDP allocates the collectives' outputs
itself, so each rank allocates exactly what it would.

The values a collective returns are garbage (an all-reduce leaves each rank's own values), which
does not matter to memory; a step whose allocations depend on values another rank sends is outside
this (the object collectives that would allocate by a garbage size are refused, see
:func:`process_groups_faked`). The probe restores parameters, gradients and optimizer state
afterwards.

This reaches into private state: c10d's group registry (``_world.pg_map``, ``_new_group_with_tag``,
the function inside a c10d logging wrapper) and ``ProcessGroup._register_backend``; the 2-rank tests
in ``tests/distributed/test_fsdp.py``, ``tests/distributed/test_step_collectives.py`` and
``tests/distributed/test_step_collectives_edges.py`` pin them.

Example::

    with process_groups_faked():
        step.run(batch)          # no rank waits for another
    consensus.min_ints([...])    # the real groups again
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from autobatch.distributed._sync import drop_unsharded_gradients
from autobatch.errors import DistributedError, PeerObjectError

__all__ = [
    "groups_faked",
    "process_groups_faked",
    "reset_fsdp2",
    "reshard_fsdp2",
]

_FAKE_BACKEND_TYPES = ("CUSTOM", "UCC", "MPI", "XCCL")
"""The backend types a group's fake backend may be registered under: the first one the group has
no backend of (a gloo or NCCL group has none of CUSTOM)."""

_FAKES: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
"""Each group's fake backend and its type, registered once: the group keeps it under that type
(c10d cannot unregister a backend), and a type registered again reuses the backend already there,
so the same one comes back each time."""

_OBJECT_RECEIVERS = ("broadcast_object_list", "scatter_object_list", "recv_object_list")
"""torch.distributed's object collectives whose receivers allocate by a size another rank sends."""

_OBJECT_REFUSAL = (
    "a receiving rank would get no object, only an allocation of whatever size its buffer held"
)
_GROUP_REFUSAL = (
    "creating a process group (new_group, new_subgroups, init_device_mesh) meets every other "
    "rank, which a rank out of memory earlier in the step never reaches: the others would wait "
    "until the group's timeout. Create the group once, before the probe, and use it in the step"
)

_DEPTH = 0
"""How many :func:`process_groups_faked` blocks are open (nested ones included)."""


@contextmanager
def process_groups_faked() -> Iterator[int]:
    """Inside the block, every process group of this process sends its collectives to a fake
    backend of its rank and size; yields how many groups (0 without torch.distributed). It is
    the whole process's: a collective another thread issues meanwhile is faked too (it returns
    that rank's own values, communicating nothing). Entering and leaving re-registers each
    group's backends, with no communication and no device memory, so every trial can afford it.
    A block inside another changes nothing: the outer one's exit puts the backends back.

    Two things that need the other ranks raise :class:`PeerObjectError` inside the block,
    however the step reaches them (``dist.<name>``, or imported ``from torch.distributed``):
    object collectives whose receiving ranks allocate by a size another rank sends
    (``broadcast_object_list``, ``scatter_object_list``, ``recv_object_list``; on a fake backend
    that size is whatever the buffer held: a garbage allocation, or an unpickling error), and
    creating a process group (``new_group``, ``new_subgroups``, ``init_device_mesh``: every
    member meets the others over the store, and a rank out of memory earlier in the step never
    comes, so the others would wait out the timeout). ``all_gather_object`` and ``gather_object``
    run, each rank getting its own object back.

    Raises:
        DistributedError: a group's own backend could not be put back (the message names the
            group and device type; the process cannot communicate on it any more), or a group
            has a backend of every type a fake one could be registered under.
    """
    global _DEPTH
    if not (dist.is_available() and dist.is_initialized()):
        yield 0
        return
    from torch.distributed.distributed_c10d import _world

    groups = list(_world.pg_map)
    swapped: list[tuple[Any, torch.device, Any]] = []
    patched: list[tuple[Any, str, Any]] = []
    _DEPTH += 1
    try:
        _refuse_peer_calls(patched)
        for group in groups:
            fake_type, fake = _fake_backend(group)
            name, desc = group.group_name, group.group_desc
            for device in group._device_types:
                try:
                    real = group._get_backend(device)
                except RuntimeError:  # a device type without a backend: nothing runs there
                    continue
                if real is fake:  # an enclosing block faked it, and puts it back
                    continue
                group._register_backend(device, fake_type, fake)
                swapped.append((group, device, real))
            # A group's name is its backend's: the fake one takes it, so that what resolves
            # the group by name (DeviceMesh, functional collectives) still finds it.
            group._set_group_name(name)
            group._set_group_desc(desc)
        yield len(groups)
    finally:
        _DEPTH -= 1
        failures: list[DistributedError] = []
        for group, device, real in reversed(swapped):
            try:
                _put_back(group, device, real)
            except DistributedError as exc:  # put every other one back first
                failures.append(exc)
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
        if failures:
            raise failures[0]


def reshard_fsdp2(model: torch.nn.Module) -> None:
    """Every ``fully_shard`` module of ``model`` back to its sharded parameters
    (``FSDPModule.reshard()``; none: nothing).

    A forward without a backward (evaluation, a user's check) leaves the root module unsharded:
    FSDP2 keeps the root's gathered parameters for the backward it expects. Those are views into
    a buffer the next step frees, so the probe reshards before it snapshots the parameters (a
    snapshot of the views was written back into freed memory: a segfault) and after its last
    step (an evaluation probe's forward leaves the root unsharded too). Resharding drops no
    value: the sharded parameters are the ones the optimizer holds."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def groups_faked() -> bool:
    """Whether a :func:`process_groups_faked` block is open (in any thread): collectives then
    communicate nothing, so nothing that must agree with the other ranks can run."""
    return _DEPTH > 0


def _refuse_peer_calls(patched: list[tuple[Any, str, Any]]) -> None:
    """Make the object receivers and group creation raise :class:`PeerObjectError`; appends
    ``(owner, attribute, original)`` for each change, to set back in reverse order.

    torch.distributed's public functions are c10d's logging wrappers, and ``from torch.distributed
    import broadcast_object_list`` binds the wrapper itself: the function it calls (its closure's
    ``func``) is swapped, so every reference refuses. Group creation goes through c10d's
    module-level ``_new_group_with_tag``, looked up at each call."""
    from torch.distributed import distributed_c10d

    for name in _OBJECT_RECEIVERS:
        function = getattr(distributed_c10d, name)
        names = getattr(getattr(function, "__code__", None), "co_freevars", ())
        cells = getattr(function, "__closure__", None) or ()
        cell = dict(zip(names, cells, strict=False)).get("func")
        if cell is not None and getattr(cell.cell_contents, "__name__", None) == name:
            patched.append((cell, "cell_contents", cell.cell_contents))
            cell.cell_contents = _refusing(name, _OBJECT_REFUSAL)
            continue
        for module in (dist, distributed_c10d):  # not a wrapper: the names, at least
            patched.append((module, name, getattr(module, name)))
            setattr(module, name, _refusing(name, _OBJECT_REFUSAL))
    patched.append((distributed_c10d, "_new_group_with_tag", distributed_c10d._new_group_with_tag))
    distributed_c10d._new_group_with_tag = _refusing("new_group", _GROUP_REFUSAL)


def reset_fsdp2(model: torch.nn.Module) -> None:
    """After a step that raised mid-forward or mid-backward: FSDP2's own recovery,
    ``reset_iter_state()`` on the root ``fully_shard`` module (the first in ``model.modules()``):
    it reshards every parameter group and clears the step's trackers, so the next step runs;
    and the unsharded gradients an earlier micro-step without the reduction left are dropped."""
    from torch.distributed.fsdp import FSDPModule

    drop_unsharded_gradients(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reset_iter_state()
            return


def _fake_backend(group: Any) -> tuple[Any, Any]:
    """``group``'s fake backend and the type to register it under (made on first use)."""
    from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup

    known = _FAKES.get(group)
    if known is not None:
        return known
    for name in _FAKE_BACKEND_TYPES:
        backend_type = getattr(ProcessGroup.BackendType, name)
        if not _has_backend_type(group, backend_type):
            fake = FakeProcessGroup._create_internal(group.rank(), group.size())
            _FAKES[group] = (backend_type, fake)
            return backend_type, fake
    raise DistributedError(
        f"cannot probe without communication: process group {group.group_name!r} has a backend "
        f"of every type ({', '.join(_FAKE_BACKEND_TYPES)}) a fake one could take while the "
        "step runs; probe with a group of standard backends (gloo, nccl)"
    )


def _put_back(group: Any, device: torch.device, real: Any) -> None:
    """Make ``real`` ``group``'s backend for ``device`` again: registered under its own type
    (by its name, else whichever type holds it), which c10d reuses rather than replaces."""
    from torch._C._distributed_c10d import ProcessGroup

    fake_type = _FAKES[group][0]
    by_name = dist.Backend.backend_type_map.get(str(real.name()).lower())
    if by_name not in (None, fake_type) and _registered_as(group, device, real, by_name):
        return
    for backend_type in ProcessGroup.BackendType.__members__.values():
        if backend_type in (by_name, fake_type) or not _has_backend_type(group, backend_type):
            continue
        if _registered_as(group, device, real, backend_type):
            return
    raise DistributedError(
        f"could not give process group {group.group_name!r} its own {device.type} backend "
        f"({real.name()}) back after a probe's step; its collectives on {device.type} tensors "
        "would not communicate. Please report this with your torch version"
    )


def _registered_as(group: Any, device: torch.device, real: Any, backend_type: Any) -> bool:
    """Register ``real`` for ``device`` under ``backend_type`` when the group already holds a
    backend of that type (c10d then uses that one); whether ``real`` is the device's backend now."""
    if not _has_backend_type(group, backend_type):
        return False
    try:
        group._register_backend(device, backend_type, real)
    except RuntimeError:  # that type's backend is bound to another device
        return False
    return group._get_backend(device) is real


def _has_backend_type(group: Any, backend_type: Any) -> bool:
    try:
        group._backend_id(backend_type)
    except RuntimeError:
        return False
    return True


def _refusing(name: str, why: str) -> Any:
    """A stand-in for ``torch.distributed.<name>`` that raises :class:`PeerObjectError`."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise PeerObjectError(
            f"the step calls torch.distributed.{name}, which a probe cannot run: while it runs "
            "a step, every process group's collectives go to a fake backend (no communication, "
            f"so that a rank out of memory leaves no other waiting in one), and {why}. Move "
            f"{name} out of the train_step you probe (before or after the step)"
        )

    refuse.__name__ = name
    return refuse
