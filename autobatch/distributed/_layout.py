"""The model's parallel layout: which collectives its training step runs (FSDP, tensor
parallel), and how many data-parallel ranks a plan is for.

Example::

    collective_layout(model)          # "FSDP2 (fully_shard)", or "" for a plain module
    world_size_of(model, world_size=None, process_group=None)
    resolve_world_size(model)         # (2, "the launcher's environment (WORLD_SIZE=2, ...)")
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autobatch.conditions import check_world_size, launcher_world_size
from autobatch.errors import ConfigError

__all__ = [
    "FSDP1_LAYOUT",
    "FSDP2_LAYOUT",
    "FSDP2_TP_LAYOUT",
    "TENSOR_PARALLEL_LAYOUT",
    "collective_layout",
    "resolve_world_size",
    "world_size_of",
]

FSDP2_LAYOUT = "FSDP2 (fully_shard)"
""":func:`collective_layout`'s name for a model sharded with ``fully_shard``."""

FSDP2_TP_LAYOUT = "FSDP2 (fully_shard) with tensor parallel"
""":func:`collective_layout`'s name for 2-D parallelism: ``fully_shard`` over DTensor parameters
of a mesh with a tensor-parallel dimension."""

TENSOR_PARALLEL_LAYOUT = "tensor parallel (DTensor parameters)"
""":func:`collective_layout`'s name for DTensor parameters without FSDP (``parallelize_module``)."""

FSDP1_LAYOUT = "FSDP (FullyShardedDataParallel)"
""":func:`collective_layout`'s name for a model wrapped in ``FullyShardedDataParallel``."""


def collective_layout(model: torch.nn.Module) -> str:
    """The name of the layout whose training step runs collectives inside it (FSDP's
    all-gathers and reduce-scatters), or "" when the step has none.

    The probe runs such a step with the collectives faked (an out-of-memory error in the middle
    of it leaves no other rank waiting), and refuses the one layout whose per-step state a step
    stopped in the middle leaves broken (FSDP1); see :mod:`autobatch.probing._parallel`.
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


def world_size_of(
    model: torch.nn.Module,
    *,
    world_size: int | None = None,
    process_group: dist.ProcessGroup | DeviceMesh | None = None,
) -> int:
    """The number of data-parallel ranks (W in ``E = m x k x W``): :func:`resolve_world_size`'s
    size."""
    return resolve_world_size(model, world_size=world_size, process_group=process_group)[0]


def resolve_world_size(
    model: torch.nn.Module,
    *,
    world_size: int | None = None,
    process_group: dist.ProcessGroup | DeviceMesh | None = None,
) -> tuple[int, str]:
    """The number of data-parallel ranks (W in ``E = m x k x W``) and where it came from.

    ``world_size`` is what the caller gave (an edge that also takes the alias
    ``data_parallel_size`` reconciles the two first, with
    :func:`autobatch.conditions.one_world_size`). At most one of ``world_size`` and
    ``process_group`` (the data-parallel ranks' group, or a one-dimensional DeviceMesh such as
    ``mesh["dp"]``) is given, or they agree.
    When none is given: the default group's size under an initialised torch.distributed (the
    group is what trains: a launcher's count that differs, such as Kubeflow's per-pod
    ``WORLD_SIZE``, is named in the source, not refused); before the group exists, what the
    launcher set (torchrun's ``WORLD_SIZE``, Kubeflow's, Slurm's,
    mpirun's...: :func:`autobatch.conditions.launcher_world_size`); else 1. A model whose
    parameters live on a DeviceMesh that is not the whole world as one dimension (tensor or
    2-D parallelism; HSDP's replicate x shard mesh excepted) is refused, since some of the
    ranks are then not data-parallel and dividing by all of them would make the effective batch
    too small.

    Raises:
        ConfigError: the sources disagree, a size is not a positive int, a mesh has more than
            one dimension, the data-parallel ranks cannot be told apart, or (before any process
            group exists) the launcher's variables disagree among themselves (names the fix).
    """
    given: dict[str, int] = {}
    if world_size is not None:
        given["world_size"] = check_world_size(world_size)
    if process_group is not None:
        given["process_group"] = _group_world_size(process_group)
    if len(set(given.values())) > 1:
        said = ", ".join(f"{name}={value}" for name, value in given.items())
        raise ConfigError(f"{said} disagree on the number of data-parallel ranks; pass one of them")
    if given:
        name, value = next(iter(given.items()))
        return value, f"argument {name}"
    if not (dist.is_available() and dist.is_initialized()):
        launched = launcher_world_size(os.environ)
        if launched is not None:
            return launched
        return 1, "one process (no launcher's variables, no process group)"
    world = dist.get_world_size()
    source = _group_source(world)
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
            "would make it too small; pass world_size=N, or process_group=mesh['dp'] "
            "(the data-parallel dimension of your mesh)"
        )
    return world, source


def _group_source(world: int) -> str:
    """Where an initialised default group's size came from, naming a launcher's reading that
    differs: the group is the one that trains (Kubeflow's per-pod ``WORLD_SIZE=1`` beside a
    2-rank group that ``torch.multiprocessing.spawn`` started is the pod's count, not the
    ranks'), so the launcher's variables only annotate it, and a launcher reading that cannot
    settle on one count (:func:`~autobatch.conditions.launcher_world_size` refuses) does
    not stop a job whose group already says how many ranks train."""
    source = f"the default process group (world size {world}, {dist.get_backend()})"
    try:
        launched = launcher_world_size(os.environ)
    except ConfigError as exc:
        return f"{source}; the launcher's variables do not settle a count: {exc.message}"
    if launched is None or launched[0] == world:
        return source
    return f"{source}; {launched[1]} says {launched[0]}, which counts something else (pods, tasks)"


def _group_world_size(group: dist.ProcessGroup | DeviceMesh) -> int:
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
            "torch.distributed.init_process_group first, or pass world_size=N"
        )
    return dist.get_world_size(group)


def _parameter_mesh(model: torch.nn.Module) -> DeviceMesh | None:
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh
    return None
