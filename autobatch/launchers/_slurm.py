"""Slurm's reading: a step's tasks, each one rank (inside a task) or one rank per GPU it holds
(a TaskProlog), the step's own variables before the allocation's."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from autobatch.errors import ConfigError, Remedy
from autobatch.launchers._common import (
    _FIX,
    _TORCH_NAMES,
    _UNSET_WORLD_SIZE,
    LauncherLayout,
    SlurmTaskRanks,
    _int,
    _said,
)


def _slurm_step_tasks(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """The task count of the Slurm step this process runs in, with the variable that says it
    (``SLURM_STEP_NUM_TASKS``, else the job's ``SLURM_NTASKS``); None outside a step."""
    if "SLURM_STEP_ID" not in environ:
        return None
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        tasks = _int(environ, name)
        if tasks is not None:
            return name, tasks
    return None


_GPU_COUNT = re.compile(r"(?:.*:)?(\d+)$")  # "8", "a100:8"
_TASKS_PER_NODE = re.compile(r"(\d+)(?:\(x(\d+)\))?$")  # "8", "2(x3)"


def _slurm_gpus(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    match = _GPU_COUNT.match(raw.split(",")[0])
    if match is None:
        raise ConfigError(f"{name} {raw!r} in the environment is not a GPU count", remedies=[_FIX])
    return int(match[1])


def _slurm_tasks_here(environ: Mapping[str, str], tasks: int, nodes: int | None) -> int | None:
    """Tasks of this step on this node: this node's entry of the step's
    ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE`` where the job asked for it,
    else this node's entry of the allocation's ``SLURM_TASKS_PER_NODE``.

    The step's own count comes first: a step inherits the allocation's ``SLURM_NTASKS_PER_NODE``
    (``sbatch --ntasks-per-node=8``) even when it starts fewer tasks (``srun --ntasks=1``), and
    no node runs more of a step's tasks than the step has (``tasks``).
    """
    step = _tasks_on_this_node(environ, "SLURM_STEP_TASKS_PER_NODE")
    if step is not None:
        return step
    asked = _int(environ, "SLURM_NTASKS_PER_NODE")
    if asked is not None and asked <= tasks:
        return asked
    allocated = _tasks_on_this_node(environ, "SLURM_TASKS_PER_NODE")
    if allocated is not None and allocated <= tasks:
        return allocated
    if nodes and tasks % nodes == 0:
        return tasks // nodes
    return None


def _task_list(environ: Mapping[str, str], name: str) -> list[int] | None:
    """Every node's entry of a task list such as ``"2(x3),1"`` (two tasks on each of three
    nodes, one on the fourth): ``[2, 2, 2, 1]``; None when unset or unreadable."""
    counts: list[int] = []
    for part in filter(None, environ.get(name, "").split(",")):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    return counts or None


def _tasks_on_this_node(environ: Mapping[str, str], name: str) -> int | None:
    """This node's (``SLURM_NODEID``'s) entry of a task list (:func:`_task_list`); None when
    unset, unreadable or too short."""
    counts = _task_list(environ, name) or []
    node = _int(environ, "SLURM_NODEID", minimum=0) or 0
    return counts[node] if node < len(counts) else None


def _slurm_gpu_ranks(environ: Mapping[str, str], tasks: int, gpus: int) -> int:
    """The step's ranks at one per GPU, the same reading on every node: ``tasks x gpus``, or,
    where the step's list (``SLURM_STEP_TASKS_PER_NODE``, else the allocation's
    ``SLURM_TASKS_PER_NODE`` when it counts the step's tasks) spreads its tasks unevenly and
    the tasks share their node's GPUs, each node's tasks x their share, summed over the nodes,
    every node holding this node's GPUs (``--gres=gpu:N``, ``--gpus-per-node``).

    Raises:
        ConfigError: a node's GPUs cannot be shared evenly by its tasks.
    """
    if _slurm_gpus(environ, "SLURM_GPUS_PER_TASK"):
        return tasks * gpus
    name = "SLURM_STEP_TASKS_PER_NODE"
    name = name if environ.get(name, "").strip() else "SLURM_TASKS_PER_NODE"
    counts = _task_list(environ, name)
    if counts is None or sum(counts) != tasks or len(set(counts)) == 1:
        return tasks * gpus
    where = f"a node running {{}} of the step's tasks ({name}={environ[name]})"
    return sum(n * _slurm_gpus_per_task(environ, n, where=where.format(n)) for n in counts)


def _slurm(environ: Mapping[str, str], task_ranks: SlurmTaskRanks) -> LauncherLayout | None:
    """A Slurm job's tasks (``srun``, or ``sbatch``'s step), each one rank or each one rank per
    GPU it holds (``task_ranks``)."""
    tasks = _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS")
    tasks = tasks or _int(environ, "SLURM_NPROCS")
    if tasks is None or (task_ranks == "one" and "SLURM_STEP_ID" not in environ):
        # A batch script (no step yet) is one process whatever the allocation's task count:
        # the ranks are the tasks srun starts from it.
        return None
    nodes = _int(environ, "SLURM_STEP_NUM_NODES") or _int(environ, "SLURM_JOB_NUM_NODES")
    nodes = nodes or _int(environ, "SLURM_NNODES")
    here = _slurm_tasks_here(environ, tasks, nodes)
    gpus = _slurm_gpus_per_task(environ, here)
    gpu_ranks = _slurm_gpu_ranks(environ, tasks, gpus)
    job = f"Slurm job {environ.get('SLURM_JOB_ID', '?')}"
    names = (
        "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS_PER_NODE",
        "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES",
        "SLURM_GPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_PROCID",
    )  # fmt: skip
    said = _said(environ, names)
    per_gpu = task_ranks == "gpus" and gpu_ranks != tasks
    world = gpu_ranks if per_gpu else tasks
    each = f"x {gpus} GPUs per task" if gpu_ranks == tasks * gpus else "sharing their nodes' GPUs"
    layout = LauncherLayout(
        world_size=world,
        nodes=nodes,
        ranks_per_node=None if here is None else here * (gpus if per_gpu else 1),
        rank=None if per_gpu else _int(environ, "SLURM_PROCID", minimum=0),
        local_rank=None if per_gpu else _int(environ, "SLURM_LOCALID", minimum=0),
        source=(
            f"{job}: {tasks} tasks {each}, one rank per GPU ({said})"
            if per_gpu
            else f"{job}: {tasks} tasks, one rank each{_gpus_note(gpus)} ({said})"
        ),
    )
    return _slurm_with_world_size(environ, layout, tasks=tasks, gpus=gpus, gpu_ranks=gpu_ranks)


def _gpus_note(gpus: int) -> str:
    if gpus == 1:
        return ""
    return f" (each holds {gpus} GPUs: a launcher inside a task that starts more sets WORLD_SIZE)"


def _slurm_gpus_per_task(
    environ: Mapping[str, str], here: int | None, *, where: str = "this node"
) -> int:
    """GPUs each task holds: ``SLURM_GPUS_PER_TASK``, else the node's GPUs
    (``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE``) shared by its ``here`` tasks; 1 without
    GPUs.

    Raises:
        ConfigError: the node's GPUs cannot be shared evenly by its tasks (``where`` names it).
    """
    per_task = _slurm_gpus(environ, "SLURM_GPUS_PER_TASK")
    if per_task:
        return per_task
    on_node = _slurm_gpus(environ, "SLURM_GPUS_ON_NODE") or _slurm_gpus(
        environ, "SLURM_GPUS_PER_NODE"
    )
    if not on_node or not here or on_node <= here:
        return 1
    if on_node % here:
        raise ConfigError(
            f"Slurm gives {where} {on_node} GPUs (SLURM_GPUS_ON_NODE/SLURM_GPUS_PER_NODE) for "
            f"{here} tasks, which do not share them evenly, so the ranks per task are unknown",
            remedies=[Remedy(purpose="a job that asks Slurm for --gpus-per-task"), _FIX],
        )
    return on_node // here


def _slurm_with_world_size(
    environ: Mapping[str, str], layout: LauncherLayout, *, tasks: int, gpus: int, gpu_ranks: int
) -> LauncherLayout:
    """A job's own ``WORLD_SIZE`` beside Slurm's (a batch script that exports it, or a launcher
    without torchrun's variables) must be one of Slurm's two counts: the tasks, or the tasks x
    their GPUs; it then says which."""
    world = _int(environ, "WORLD_SIZE")
    if world is None or world == layout.world_size:
        return layout
    if world not in (tasks, gpu_ranks):
        held = f"{gpus} GPUs each" if gpu_ranks == tasks * gpus else "their nodes' GPUs"
        raise ConfigError(
            f"WORLD_SIZE={world} disagrees with {layout.source.split(':')[0]}: SLURM_NTASKS="
            f"{tasks} tasks with {held} make {tasks} ranks (one per task) or "
            f"{gpu_ranks} (one per GPU), not {world}",
            remedies=[_UNSET_WORLD_SIZE, _FIX],
        )
    one_each = world == tasks
    return dataclasses.replace(
        layout,
        world_size=world,
        ranks_per_node=None,
        rank=_int(environ, "RANK", minimum=0) if not one_each else layout.rank,
        local_rank=_int(environ, "LOCAL_RANK", minimum=0) if not one_each else layout.local_rank,
        source=f"{_said(environ, ('WORLD_SIZE',) if one_each else _TORCH_NAMES)}, one rank "
        f"{'per task' if one_each else 'per GPU'} of {layout.source}",
    )
