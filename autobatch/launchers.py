"""How many ranks train, read from what the launcher set in the environment, before any process
group exists: torchrun (and ``accelerate launch``, which runs it), Kubeflow's PyTorchJob and
TrainJob, Slurm's ``srun``/``sbatch``, the DeepSpeed launcher, and ``mpirun`` (Open MPI, MPICH,
Intel MPI, MVAPICH). docs/launchers.md lists, per launcher, which variables are read.

The innermost launcher decides: a process torchrun started inside a Slurm task or a Kubeflow pod
reads torchrun's variables, which count the processes it really started. Where two readings of
one layout disagree, :class:`~autobatch.errors.ConfigError` names the variables, their values
and the fix (``world_size=N``), never a silent guess; where a launcher's documented semantics
settle it (Kubeflow's ``WORLD_SIZE`` counts pods), the reading says why it chose.

Pure: a mapping of variables in, a :class:`LauncherLayout` out; imports neither torch nor pynvml.

Example::

    layout = launcher_layout(os.environ)
    if layout is not None:
        layout.world_size, layout.source   # (16, "Slurm job 908: 2 tasks x 8 GPUs per task ...")
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Literal

from autobatch.errors import ConfigError

__all__ = ["LauncherLayout", "SlurmTaskRanks", "launcher_layout"]

SlurmTaskRanks = Literal["one", "gpus"]
"""How many ranks a Slurm task is: ``"one"`` (the process Slurm started trains as one rank, the
reading inside a task), or ``"gpus"`` (each task starts one rank per GPU it holds, as a torchrun
per node does: the reading of a TaskProlog, before the task's command runs)."""

_FIX = "pass world_size=N (the number of data-parallel ranks that train)"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LauncherLayout:
    """The ranks a launcher started, as its environment says."""

    world_size: int
    """Ranks in the job (>= 1)."""
    nodes: int | None
    """Nodes (hosts, pods) the ranks run on; None when the launcher does not say."""
    ranks_per_node: int | None
    """Ranks on this node; None when the launcher does not say."""
    rank: int | None
    """This process's rank; None where the process is not itself a rank (a TaskProlog, or a
    pod's entry process before torchrun starts the ranks)."""
    local_rank: int | None
    """This process's rank on its node; None as for ``rank``."""
    source: str
    """The launcher and the variables read, e.g. ``"torchrun (WORLD_SIZE=16, RANK=3,
    LOCAL_RANK=3, LOCAL_WORLD_SIZE=8, GROUP_WORLD_SIZE=2)"``."""


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 1) -> int | None:
    """``environ[name]`` as an int >= ``minimum``; None when unset or blank.

    Raises:
        ConfigError: set to something else.
    """
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(
            f"{name} {raw!r} in the environment must be an int >= {minimum}; unset it, or {_FIX}"
        )
    return value


def _said(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{name}={environ[name]}" for name in names if environ.get(name, "").strip())


def _torchrun(environ: Mapping[str, str]) -> LauncherLayout | None:
    """torchrun's children (``accelerate launch`` runs torchrun): they carry
    ``TORCHELASTIC_RUN_ID`` or ``LOCAL_WORLD_SIZE`` with ``GROUP_RANK``."""
    marked = "TORCHELASTIC_RUN_ID" in environ or (
        "LOCAL_WORLD_SIZE" in environ and "GROUP_RANK" in environ
    )
    world = _int(environ, "WORLD_SIZE")
    if not marked or world is None:
        return None
    local = _int(environ, "LOCAL_WORLD_SIZE")
    groups = _int(environ, "GROUP_WORLD_SIZE")
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")
    if local is not None and groups is not None and local * groups != world:
        raise ConfigError(
            f"torchrun's variables disagree: WORLD_SIZE={world} but GROUP_WORLD_SIZE={groups} "
            f"nodes x LOCAL_WORLD_SIZE={local} = {groups * local}; {_FIX}"
        )
    nodes = groups if groups is not None else (world // local if local else None)
    name = "accelerate launch (torchrun)" if _accelerate(environ) else "torchrun"
    return LauncherLayout(
        world_size=world,
        nodes=nodes,
        ranks_per_node=local,
        rank=_int(environ, "RANK", minimum=0),
        local_rank=_int(environ, "LOCAL_RANK", minimum=0),
        source=f"{name} ({_said(environ, names)}){_inside(environ)}",
    )


def _accelerate(environ: Mapping[str, str]) -> bool:
    return any(name.startswith("ACCELERATE_") for name in environ)


def _inside(environ: Mapping[str, str]) -> str:
    """Where an inner launcher runs, for the source: a Slurm job or a Kubeflow pod."""
    if "SLURM_JOB_ID" in environ:
        return f" in Slurm job {environ['SLURM_JOB_ID']}"
    if "PET_NNODES" in environ or "PET_NPROC_PER_NODE" in environ:
        return " in a Kubeflow pod"
    return ""


def _deepspeed(environ: Mapping[str, str]) -> LauncherLayout | None:
    """The DeepSpeed launcher's children: ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` beside
    ``LOCAL_SIZE`` (ranks on this node) and ``CROSS_SIZE`` (nodes in the hostfile)."""
    if "CROSS_SIZE" not in environ and "LOCAL_SIZE" not in environ:
        return None
    world = _int(environ, "WORLD_SIZE")
    if world is None:
        return None
    local = _int(environ, "LOCAL_SIZE")
    nodes = _int(environ, "CROSS_SIZE")
    # A hostfile may give nodes unequal slots, so WORLD_SIZE need not be nodes x LOCAL_SIZE; it
    # can never be less than either.
    if (local is not None and local > world) or (nodes is not None and nodes > world):
        raise ConfigError(
            f"the DeepSpeed launcher's variables disagree: WORLD_SIZE={world} is less than "
            f"LOCAL_SIZE={local} ranks on this node or CROSS_SIZE={nodes} nodes; {_FIX}"
        )
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_SIZE")
    return LauncherLayout(
        world_size=world,
        nodes=nodes,
        ranks_per_node=local,
        rank=_int(environ, "RANK", minimum=0),
        local_rank=_int(environ, "LOCAL_RANK", minimum=0),
        source=f"the DeepSpeed launcher ({_said(environ, names)}){_inside(environ)}",
    )


_MPI = (
    # (launcher, size, rank, local rank, local size)
    (
        "mpirun (Open MPI)",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "mpirun (MVAPICH)",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "",
    ),
    ("mpirun (MPICH or Intel MPI)", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _mpi(environ: Mapping[str, str]) -> LauncherLayout | None:
    """A rank ``mpirun``/``mpiexec`` started. ``srun --mpi=pmi2`` sets ``PMI_SIZE`` to its own
    task count too: inside a Slurm step that one is Slurm's, read as Slurm's."""
    for launcher, size_name, rank_name, local_name, local_size_name in _MPI:
        size = _int(environ, size_name)
        if size is None:
            continue
        if size_name == "PMI_SIZE" and "SLURM_STEP_ID" in environ:
            return None
        world = _int(environ, "WORLD_SIZE")
        names = tuple(n for n in (size_name, rank_name, local_name, local_size_name) if n)
        if world is not None and world != size:
            raise ConfigError(
                f"WORLD_SIZE={world} but {size_name}={size} ({launcher}): the environment says "
                f"two sizes of one group; unset WORLD_SIZE, or {_FIX}"
            )
        return LauncherLayout(
            world_size=size,
            nodes=None,
            ranks_per_node=_int(environ, local_size_name) if local_size_name else None,
            rank=_int(environ, rank_name, minimum=0),
            local_rank=_int(environ, local_name, minimum=0),
            source=f"{launcher} ({_said(environ, names)}){_inside(environ)}",
        )
    return None


def _kubeflow(environ: Mapping[str, str]) -> LauncherLayout | None:
    """A Kubeflow pod before torchrun runs: PyTorchJob and TrainJob set ``PET_NNODES`` (pods),
    ``PET_NPROC_PER_NODE`` (ranks per pod) and ``PET_NODE_RANK``, which torchrun reads as its
    flags. PyTorchJob also sets ``WORLD_SIZE``, to the number of pods (or, in newer operators,
    pods x ``nprocPerNode``); the ranks are ``PET_NNODES`` x ``PET_NPROC_PER_NODE``."""
    if "PET_NNODES" not in environ or "PET_NPROC_PER_NODE" not in environ:
        return None
    said = _said(environ, ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "WORLD_SIZE"))
    try:
        nodes = _int(environ, "PET_NNODES")
        per_node = _int(environ, "PET_NPROC_PER_NODE")
    except ConfigError:
        # An elastic range (PET_NNODES=1:4) or PET_NPROC_PER_NODE=auto/gpu: torchrun settles
        # the size at rendezvous, after this process reads it.
        raise ConfigError(
            f"the Kubeflow pod's {said} leave the number of ranks to torchrun's rendezvous "
            f"(an elastic range, or a count by device type); {_FIX}, or read the size in the "
            "processes torchrun starts"
        ) from None
    assert nodes is not None and per_node is not None
    ranks = nodes * per_node
    world = _int(environ, "WORLD_SIZE")
    why = ""
    if world is not None and world != ranks:
        if world != nodes:
            raise ConfigError(
                f"the Kubeflow pod's variables disagree: WORLD_SIZE={world} is neither "
                f"PET_NNODES={nodes} (the pods) nor PET_NNODES x PET_NPROC_PER_NODE={ranks} (the "
                f"ranks); {_FIX}"
            )
        why = f": WORLD_SIZE={world} counts pods (PyTorchJob), each running {per_node} ranks"
    return LauncherLayout(
        world_size=ranks,
        nodes=nodes,
        ranks_per_node=per_node,
        rank=None,
        local_rank=None,
        source=f"Kubeflow, {nodes} pods x {per_node} ranks ({said}){why}",
    )


_GPU_COUNT = re.compile(r"(?:.*:)?(\d+)$")  # "8", "a100:8"
_TASKS_PER_NODE = re.compile(r"(\d+)(?:\(x(\d+)\))?$")  # "8", "2(x3)"


def _slurm_gpus(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    match = _GPU_COUNT.match(raw.split(",")[0])
    if match is None:
        raise ConfigError(f"{name} {raw!r} in the environment is not a GPU count; {_FIX}")
    return int(match[1])


def _slurm_tasks_here(environ: Mapping[str, str], tasks: int, nodes: int | None) -> int | None:
    """Tasks of this step on this node: ``SLURM_NTASKS_PER_NODE`` where the job asked for it,
    else this node's entry of ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``
    (``"2(x3),1"``: two tasks on each of three nodes, one on the fourth)."""
    asked = _int(environ, "SLURM_NTASKS_PER_NODE")
    if asked is not None:
        return asked
    raw = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, raw.split(",")):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    node = _int(environ, "SLURM_NODEID", minimum=0) or 0
    if node < len(counts):
        return counts[node]
    if nodes and tasks % nodes == 0:
        return tasks // nodes
    return None


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
    job = f"Slurm job {environ.get('SLURM_JOB_ID', '?')}"
    names = (
        "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NUM_NODES",
        "SLURM_GPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_PROCID",
    )  # fmt: skip
    said = _said(environ, names)
    per_gpu = task_ranks == "gpus" and gpus > 1
    world = tasks * gpus if per_gpu else tasks
    layout = LauncherLayout(
        world_size=world,
        nodes=nodes,
        ranks_per_node=None if here is None else here * (gpus if per_gpu else 1),
        rank=None if per_gpu else _int(environ, "SLURM_PROCID", minimum=0),
        local_rank=None if per_gpu else _int(environ, "SLURM_LOCALID", minimum=0),
        source=(
            f"{job}: {tasks} tasks x {gpus} GPUs per task, one rank per GPU ({said})"
            if per_gpu
            else f"{job}: {tasks} tasks, one rank each{_gpus_note(gpus)} ({said})"
        ),
    )
    return _slurm_with_world_size(environ, layout, tasks=tasks, gpus=gpus)


def _gpus_note(gpus: int) -> str:
    if gpus == 1:
        return ""
    return f" (each holds {gpus} GPUs: a launcher inside a task that starts more sets WORLD_SIZE)"


def _slurm_gpus_per_task(environ: Mapping[str, str], here: int | None) -> int:
    """GPUs each task holds: ``SLURM_GPUS_PER_TASK``, else the node's GPUs
    (``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE``) shared by its tasks; 1 without GPUs."""
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
            f"Slurm gives this node {on_node} GPUs (SLURM_GPUS_ON_NODE/SLURM_GPUS_PER_NODE) for "
            f"{here} tasks, which do not share them evenly, so the ranks per task are unknown; "
            f"ask for --gpus-per-task, or {_FIX}"
        )
    return on_node // here


def _slurm_with_world_size(
    environ: Mapping[str, str], layout: LauncherLayout, *, tasks: int, gpus: int
) -> LauncherLayout:
    """A job's own ``WORLD_SIZE`` beside Slurm's (a batch script that exports it, or a launcher
    without torchrun's variables) must be one of Slurm's two counts: the tasks, or the tasks x
    their GPUs; it then says which."""
    world = _int(environ, "WORLD_SIZE")
    if world is None or world == layout.world_size:
        return layout
    if world not in (tasks, tasks * gpus):
        raise ConfigError(
            f"WORLD_SIZE={world} disagrees with {layout.source.split(':')[0]}: SLURM_NTASKS="
            f"{tasks} tasks with {gpus} GPUs each make {tasks} ranks (one per task) or "
            f"{tasks * gpus} (one per GPU), not {world}; unset WORLD_SIZE, or {_FIX}"
        )
    one_each = world == tasks
    return dataclasses.replace(
        layout,
        world_size=world,
        ranks_per_node=None,
        rank=_int(environ, "RANK", minimum=0) if not one_each else layout.rank,
        local_rank=_int(environ, "LOCAL_RANK", minimum=0) if not one_each else layout.local_rank,
        source=f"WORLD_SIZE={world}, one rank {'per task' if one_each else 'per GPU'} of "
        f"{layout.source}",
    )


_TORCH_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def _world_size(environ: Mapping[str, str]) -> LauncherLayout | None:
    """A bare ``WORLD_SIZE`` (a launcher that sets only it, ``RANK`` and ``LOCAL_RANK``:
    Kubeflow's PyTorchJob with one process per pod, Lightning's own launcher, a user's script)."""
    world = _int(environ, "WORLD_SIZE")
    if world is None:
        return None
    return LauncherLayout(
        world_size=world,
        nodes=None,
        ranks_per_node=None,
        rank=_int(environ, "RANK", minimum=0),
        local_rank=_int(environ, "LOCAL_RANK", minimum=0),
        source=f"the launcher's environment ({_said(environ, _TORCH_NAMES)})",
    )


def launcher_layout(
    environ: Mapping[str, str], *, slurm_task_ranks: SlurmTaskRanks = "one"
) -> LauncherLayout | None:
    """The ranks a launcher started, read from its environment; None when no launcher did.

    The innermost launcher decides, in this order: torchrun's children (``accelerate launch``
    included), the DeepSpeed launcher's, an MPI launcher's ranks, a Kubeflow pod before torchrun
    (``PET_*``), a Slurm step, a bare ``WORLD_SIZE``.

    Args:
        environ: the variables, e.g. ``os.environ``.
        slurm_task_ranks: how many ranks a Slurm task is (:data:`SlurmTaskRanks`): ``"one"``
            inside a task, which is itself one rank unless a launcher inside it says otherwise;
            ``"gpus"`` before the task's command runs (a TaskProlog), when each task will start
            one rank per GPU it holds (a torchrun per node).

    Returns:
        The layout, its ``source`` naming the launcher and the variables read; None without a
        launcher's variables.

    Raises:
        ConfigError: a variable is not a count, or two readings disagree (``WORLD_SIZE`` beside
            Kubeflow's ``PET_*``, Slurm's tasks and GPUs, or an MPI size); the message names
            the variables, their values and the fix (``world_size=N``).
    """
    return (
        _torchrun(environ)
        or _deepspeed(environ)
        or _mpi(environ)
        or _kubeflow(environ)
        or _slurm(environ, slurm_task_ranks)
        or _world_size(environ)
    )
