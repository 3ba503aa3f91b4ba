"""Probing under torch.distributed: every rank probes its own device, and all agree on one answer.

:class:`ProcessGroupConsensus` is the probe's :class:`~autobatch.probing.Consensus` over a process
group: element-wise MIN all-reduces and broadcasts from rank 0 of small int64 tensors (on the CPU
for gloo, on the current CUDA device for nccl, so call ``torch.cuda.set_device(local_rank)``
first). With it, every rank runs the same micro-batch sizes in the same order; a size fits only
if it fits on every rank, so a smaller or busier card lowers the plan for all; a non-OOM failure
on one rank ends the probe on every rank within the same collective (no rank is left waiting).

:func:`autobatch.autotune` uses it by itself when ``torch.distributed`` is initialised: rank 0
alone reads and writes the profile store, and every rank returns rank 0's profile, so every rank
gets the same Plan.

Example::

    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    plan = autobatch.autotune(model, sample, effective_batch_size=1024)  # world_size: the group's
    # or, for a probe alone:
    profile = autobatch.probe(model, sample, consensus=ProcessGroupConsensus())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autobatch.errors import DistributedError
from autobatch.fake_collectives import groups_faked

__all__ = [
    "FSDP1_LAYOUT",
    "FSDP2_LAYOUT",
    "FSDP2_TP_LAYOUT",
    "TENSOR_PARALLEL_LAYOUT",
    "ProcessGroupConsensus",
    "collective_layout",
    "consensus_device",
    "data_parallel_size",
    "process_group_consensus",
]

T = TypeVar("T")

FSDP2_LAYOUT = "FSDP2 (fully_shard)"
""":func:`collective_layout`'s name for a model sharded with ``fully_shard``."""

FSDP2_TP_LAYOUT = "FSDP2 (fully_shard) with tensor parallel"
""":func:`collective_layout`'s name for 2-D parallelism: ``fully_shard`` over DTensor parameters
of a mesh with a tensor-parallel dimension."""

TENSOR_PARALLEL_LAYOUT = "tensor parallel (DTensor parameters)"
""":func:`collective_layout`'s name for DTensor parameters without FSDP (``parallelize_module``)."""

FSDP1_LAYOUT = "FSDP (FullyShardedDataParallel)"
""":func:`collective_layout`'s name for a model wrapped in ``FullyShardedDataParallel``."""


class ProcessGroupConsensus:
    """Agreement between the ranks of a torch.distributed process group.

    Every rank must make the same calls in the same order (they are collectives).

    Args:
        group: the process group; None means the default (``WORLD``) group.
        device: the device this rank probes. Under nccl the agreement's small tensors go there
            (a CUDA device), not to the current CUDA device, which on a rank that never called
            ``torch.cuda.set_device`` is cuda:0, another rank's GPU. None: the current device.

    Raises:
        DistributedError: torch.distributed is not available or not initialised, the group
            is bound to another CUDA device than ``device`` (``init_process_group(device_id=)``),
            or the process groups are faked (inside a step a probe runs: no agreement could
            communicate).
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "torch.distributed is not initialised; call torch.distributed.init_process_group "
                "first (torchrun sets the environment it reads)"
            )
        if groups_faked():
            raise DistributedError(
                "cannot probe under torch.distributed while every process group's collectives "
                "go to a fake backend (inside a train_step that a probe is running, or a "
                "process_groups_faked block): the ranks' agreement would communicate nothing, "
                "and each rank would get its own answer. Call autotune outside them"
            )
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._src = 0 if group is None else dist.get_global_rank(group, 0)
        pg = group if group is not None else dist.group.WORLD
        self._device = consensus_device(
            str(dist.get_backend(group)),
            probed=device,
            bound=getattr(pg, "bound_device_id", None),
            current_cuda_index=torch.cuda.current_device,
        )

    @property
    def device(self) -> torch.device:
        """Where the agreement's tensors live: the CPU for gloo, a CUDA device otherwise."""
        return self._device

    def __repr__(self) -> str:
        return (
            f"ProcessGroupConsensus(rank={self._rank}, world_size={self._world_size}, "
            f"device={self._device})"
        )

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world_size

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over the ranks (one all-reduce of ``len(values)`` int64s)."""
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        return [int(value) for value in tensor.tolist()]

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank (one broadcast of ``len(values)`` int64s)."""
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        dist.broadcast(tensor, src=self._src, group=self._group)
        return [int(value) for value in tensor.tolist()]

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` (picklable), on every rank; the others' ``obj`` is ignored."""
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self._group, device=self._device)
        return cast(T, box[0])

    def all_equal(self, value: str) -> bool:
        """True on every rank when every rank's ``value`` equals rank 0's."""
        first = self.broadcast_object(value)
        return self.min_ints([int(value == first)])[0] == 1

    def on_rank_zero(self, work: Callable[[], T], doing: str) -> T:
        """Run ``work`` on rank 0 only; its result (picklable) on every rank.

        Args:
            work: what rank 0 does (e.g. read the profile store).
            doing: what it is, for the other ranks' error message (e.g. "reading the store").

        Raises:
            DistributedError: on the other ranks, when ``work`` raised on rank 0 (which raises
                the original exception).
        """
        if self._rank == 0:
            try:
                result = work()
            except Exception as exc:
                self.broadcast_object(_Failure(f"{type(exc).__name__}: {exc}"))
                raise
            return self.broadcast_object(result)
        received: object = self.broadcast_object(None)
        if isinstance(received, _Failure):
            raise DistributedError(f"rank 0 failed while {doing}: {received.message}")
        return cast(T, received)


class _Failure:
    """What rank 0 broadcasts instead of a result when its work raised."""

    def __init__(self, message: str) -> None:
        self.message = message


def process_group_consensus(device: torch.device | None = None) -> ProcessGroupConsensus | None:
    """The default group's consensus when torch.distributed is initialised, else None.

    Args:
        device: the device this rank probes (see :class:`ProcessGroupConsensus`).
    """
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupConsensus(device=device)
    return None


def consensus_device(
    backend: str,
    *,
    probed: torch.device | None,
    bound: torch.device | None,
    current_cuda_index: Callable[[], int],
) -> torch.device:
    """Where a consensus over ``backend`` puts its tensors.

    gloo and mpi: the CPU. Otherwise (nccl) a CUDA device: the probed one when it is CUDA, else
    the one the group is bound to, else the current one. Pure apart from ``current_cuda_index``,
    which is called only when nothing else says.

    Raises:
        DistributedError: the group is bound to a CUDA device other than the probed one.
    """
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if probed is not None and probed.type == "cuda":
        probed = torch.device("cuda", probed.index if probed.index is not None else 0)
        if bound is not None and bound != probed:
            raise DistributedError(
                f"this rank probes {probed} but its process group is bound to {bound} "
                f"(init_process_group(device_id={bound})); agreeing on {bound} would leave a "
                f"CUDA context on a GPU this rank does not train on. Probe the GPU the group "
                f"is bound to (device='{bound}', with the model moved there), or bind the "
                f"group to {probed}"
            )
        return probed
    if bound is not None:
        return bound
    return torch.device("cuda", current_cuda_index())


def collective_layout(model: torch.nn.Module) -> str:
    """The name of the layout whose training step runs collectives inside it (FSDP's
    all-gathers and reduce-scatters), or "" when the step has none.

    The probe runs such a step with the collectives faked (an out-of-memory error in the middle
    of it leaves no other rank waiting), and refuses the one layout whose per-step state a step
    stopped in the middle leaves broken (FSDP1); see :mod:`autobatch.layouts`.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        if isinstance(module, FSDPModule):
            if _beyond_fsdp2_meshes(model):
                return FSDP2_TP_LAYOUT
            return FSDP2_LAYOUT
        if isinstance(module, FullyShardedDataParallel):
            return FSDP1_LAYOUT
    if any(isinstance(param, DTensor) for param in model.parameters()):
        return TENSOR_PARALLEL_LAYOUT
    return ""


def _beyond_fsdp2_meshes(model: torch.nn.Module) -> bool:
    """True when some parameter lives on a DeviceMesh that no ``fully_shard`` module shards
    over (2-D FSDP2 + tensor parallel: the parameter's mesh also has the tensor-parallel
    dimension), so the step runs collectives that are not FSDP2's own."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    meshes = [
        group.mesh_info.mesh
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]
    return any(
        isinstance(param, DTensor) and all(param.device_mesh != mesh for mesh in meshes)
        for param in model.parameters()
    )


def data_parallel_size(
    model: torch.nn.Module,
    *,
    world_size: int | None = None,
    data_parallel_size: int | None = None,
    process_group: dist.ProcessGroup | DeviceMesh | None = None,
) -> int:
    """The number of data-parallel ranks (W in ``E = m x k x W``), from what the caller said.

    At most one of ``world_size``, ``data_parallel_size`` and ``process_group`` (the data-parallel
    ranks' group, or a one-dimensional DeviceMesh such as ``mesh["dp"]``) is given, or they agree.
    When none is given: the default group's size under an initialised torch.distributed, else 1;
    but a model whose parameters live on a DeviceMesh that is not the whole world as one
    dimension (tensor or 2-D parallelism; HSDP's replicate x shard mesh excepted) is refused,
    since some of the ranks are then not data-parallel and dividing by all of them would make
    the effective batch too small.

    Raises:
        ConfigError: the sources disagree, a size is not a positive int, a mesh has more than
            one dimension, or the data-parallel ranks cannot be told apart (names the fix).
    """
    from autobatch.errors import ConfigError

    given: dict[str, int] = {}
    for name, value in (("world_size", world_size), ("data_parallel_size", data_parallel_size)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} {value!r} must be an int >= 1 (data-parallel ranks)")
        given[name] = value
    if process_group is not None:
        given["process_group"] = _group_size(process_group)
    if len(set(given.values())) > 1:
        said = ", ".join(f"{name}={value}" for name, value in given.items())
        raise ConfigError(f"{said} disagree on the number of data-parallel ranks; pass one of them")
    if given:
        return next(iter(given.values()))
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    world = dist.get_world_size()
    mesh = _parameter_mesh(model)
    # HSDP's 2-D mesh (replicate x shard) is all data-parallel; any other mesh that is not the
    # whole world as one dimension has ranks that share samples.
    other = mesh is not None and mesh.ndim > 1 and collective_layout(model) != FSDP2_LAYOUT
    if mesh is not None and (other or mesh.size() != world):
        names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        raise ConfigError(
            f"the model's parameters are on a DeviceMesh of shape {tuple(mesh.shape)}{names} in "
            f"a world of {world} ranks, so not every rank is data-parallel (tensor or pipeline "
            f"parallel ranks share each sample), and dividing the effective batch by {world} "
            "would make it too small; pass data_parallel_size=N, or process_group=mesh['dp'] "
            "(the data-parallel dimension of your mesh)"
        )
    return world


def _group_size(group: dist.ProcessGroup | DeviceMesh) -> int:
    from autobatch.errors import ConfigError

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ConfigError(
                f"process_group is a DeviceMesh of {group.ndim} dimensions "
                f"{group.mesh_dim_names or ''}; pass its data-parallel dimension, e.g. "
                "mesh['dp']"
            )
        return group.size()
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first, or pass data_parallel_size=N"
        )
    return dist.get_world_size(group)


def _parameter_mesh(model: torch.nn.Module) -> DeviceMesh | None:
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh
    return None
