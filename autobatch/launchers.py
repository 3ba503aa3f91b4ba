"""How many ranks train, read from what the launcher set in the environment, before any process
group exists: torchrun (and ``accelerate launch``, which runs it), Kubeflow's PyTorchJob and
TrainJob, Slurm's ``srun``/``sbatch``, the DeepSpeed launcher, and ``mpirun`` (Open MPI, MPICH,
Intel MPI, MVAPICH). docs/launchers.md lists, per launcher, which variables are read.

The innermost launcher decides: a process torchrun started inside a Slurm task or a Kubeflow pod
reads torchrun's variables, which count the processes it really started. A Slurm step's own
variables (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NUM_NODES``) come
before the allocation's (``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``...): ``srun --ntasks=1``
inside ``sbatch --ntasks-per-node=8`` starts one task per node, whatever the allocation asked.
Where two launchers' variables disagree (an MPI launcher's ``PMI_*``/``OMPI_*``/``MV2_*``/``PMIX_*``
or torchrun's against the Slurm step they run in, torchrun's against an MPI launcher's),
:class:`~autobatch.errors.ConfigError` names the variables, their values and the fix (a
:class:`~autobatch.errors.Remedy` for ``world_size``, which each surface words: ``world_size=N``
in Python, ``--world-size N`` on the command line), never a silent guess; where a launcher's
documented semantics settle it (Kubeflow's ``WORLD_SIZE`` counts pods), the reading says why it
chose.

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

from autobatch.errors import ConfigError, Remedy

__all__ = ["LauncherLayout", "SlurmTaskRanks", "launcher_layout"]

SlurmTaskRanks = Literal["one", "gpus"]
"""How many ranks a Slurm task is: ``"one"`` (the process Slurm started trains as one rank, the
reading inside a task), or ``"gpus"`` (each task starts one rank per GPU it holds, as a torchrun
per node does: the reading of a TaskProlog, before the task's command runs)."""


class _Count(str):
    """A count the user fills in, shown as its bare name in every spelling: ``world_size=N`` in
    Python, ``--world-size N`` on the command line."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


_RANKS = "the number of data-parallel ranks that train"
_FIX = Remedy(parameter="world_size", values=(_Count("N"),), purpose=_RANKS)
"""The fix for every launcher's disagreement: say how many ranks train."""
_UNSET_WORLD_SIZE = Remedy(purpose="an environment without WORLD_SIZE")


def _world_size_is(ranks: int, why: str) -> Remedy:
    """The fix naming one reading's count, e.g. ``world_size=16 (if mpiexec started the ranks)``."""
    return Remedy(parameter="world_size", values=(ranks,), purpose=why)


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
            f"{name} {raw!r} in the environment must be an int >= {minimum}",
            remedies=[Remedy(purpose=f"an environment without {name}"), _FIX],
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
            f"nodes x LOCAL_WORLD_SIZE={local} = {groups * local}",
            remedies=[_FIX],
        )
    nodes = groups if groups is not None else (world // local if local else None)
    if nodes is not None:
        _torchrun_against_outer(environ, world=world, agents=nodes, said=_said(environ, names))
    name = "accelerate launch (torchrun)" if _accelerate(environ) else "torchrun"
    return LauncherLayout(
        world_size=world,
        nodes=nodes,
        ranks_per_node=local,
        rank=_int(environ, "RANK", minimum=0),
        local_rank=_int(environ, "LOCAL_RANK", minimum=0),
        source=f"{name} ({_said(environ, names)}){_inside(environ)}",
    )


def _torchrun_against_outer(
    environ: Mapping[str, str], *, world: int, agents: int, said: str
) -> None:
    """Refuse torchrun's count of agents (nodes) when the Slurm step or MPI launcher that runs
    it started another number of them: each Slurm task or MPI rank runs one torchrun agent, so
    the counts differ only when the torchruns are not one group (``--nnodes`` other than the
    tasks) or the outer launcher's variables are another job's.

    Raises:
        ConfigError: the two counts differ (both named, with their values).
    """
    step = _slurm_step_tasks(environ)
    if step is not None:
        _mpi_against_slurm(environ, step)
        outer_name, outer = step
        launcher, each = f"Slurm job {environ.get('SLURM_JOB_ID', '?')}'s step", "task"
    else:
        found = [(name, size) for _, name, *_ in _MPI if (size := _int(environ, name)) is not None]
        if not found:
            return
        (outer_name, outer), launcher, each = found[0], "the MPI launcher", "MPI rank"
    if outer == agents:
        return
    raise ConfigError(
        f"torchrun's variables ({said}) make {agents} torchrun agents (nodes), but {launcher} "
        f"says {outer_name}={outer}, one torchrun each: the torchruns are not one group of "
        f"{world} ranks, or the environment holds another job's variables",
        remedies=[
            Remedy(purpose=f"torchrun --nnodes={outer} (one agent per {each})"),
            _world_size_is(world, "if torchrun's WORLD_SIZE counts every rank that trains"),
        ],
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
            f"LOCAL_SIZE={local} ranks on this node or CROSS_SIZE={nodes} nodes",
            remedies=[_FIX],
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
    task count too: inside a Slurm step, a ``PMI_SIZE`` equal to the step's tasks is Slurm's,
    read as Slurm's; any MPI count that differs from the step's is refused
    (:func:`_mpi_against_slurm`)."""
    step = _slurm_step_tasks(environ)
    if step is not None:
        _mpi_against_slurm(environ, step)
    for launcher, size_name, rank_name, local_name, local_size_name in _MPI:
        size = _int(environ, size_name)
        if size is None:
            continue
        if size_name == "PMI_SIZE" and step is not None:
            return None
        world = _int(environ, "WORLD_SIZE")
        names = tuple(n for n in (size_name, rank_name, local_name, local_size_name) if n)
        if world is not None and world != size:
            raise ConfigError(
                f"WORLD_SIZE={world} but {size_name}={size} ({launcher}): the environment says "
                "two sizes of one group",
                remedies=[_UNSET_WORLD_SIZE, _FIX],
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


def _mpi_against_slurm(environ: Mapping[str, str], step: tuple[str, int]) -> None:
    """Refuse an MPI launcher's count that differs from the Slurm step it runs in.

    MPICH's and Intel MPI's ``mpiexec`` (Hydra) inside an allocation starts its proxies with
    ``srun``, one per node: the ranks see the proxies' step (``SLURM_STEP_NUM_TASKS=2``) beside
    ``PMI_SIZE=16``; ``srun --mpi=pmi2`` sets both to the step's tasks. Neither reading can tell
    which launcher started the ranks, so the message names both.

    Raises:
        ConfigError: ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE`` or ``MV2_COMM_WORLD_SIZE`` is not the
            step's task count, or ``PMIX_RANK`` is not below it.
    """
    step_name, tasks = step
    said = f"Slurm job {environ.get('SLURM_JOB_ID', '?')}'s step says {step_name}={tasks}"
    for launcher, size_name, *_ in _MPI:
        size = _int(environ, size_name)
        if size is not None and size != tasks:
            raise ConfigError(
                f"{launcher} says {size_name}={size} but {said}: an MPI launcher inside a "
                "Slurm step (mpiexec's proxies started with srun, one per node) counts other "
                "processes than the step's tasks, and the environment cannot say which started "
                "the ranks",
                remedies=[
                    _world_size_is(size, f"if {launcher.split()[0]} started the ranks"),
                    _world_size_is(tasks, "if srun started them, one rank per task"),
                ],
            )
    rank = _int(environ, "PMIX_RANK", minimum=0)
    if rank is not None and rank >= tasks:
        raise ConfigError(
            f"PMIx says PMIX_RANK={rank} but {said}: a rank beyond the step's tasks was started "
            "by an MPI launcher inside the step, which counts other processes than Slurm",
            remedies=[_FIX],
        )


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
            "(an elastic range, or a count by device type)",
            remedies=[_FIX, Remedy(purpose="a reading in the processes torchrun starts")],
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
                "ranks)",
                remedies=[_FIX],
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


def _tasks_on_this_node(environ: Mapping[str, str], name: str) -> int | None:
    """This node's (``SLURM_NODEID``'s) entry of a task list such as ``"2(x3),1"`` (two tasks
    on each of three nodes, one on the fourth); None when unset, unreadable or too short."""
    counts: list[int] = []
    for part in filter(None, environ.get(name, "").split(",")):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    node = _int(environ, "SLURM_NODEID", minimum=0) or 0
    return counts[node] if node < len(counts) else None


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
        "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS_PER_NODE",
        "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES",
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
            f"{here} tasks, which do not share them evenly, so the ranks per task are unknown",
            remedies=[Remedy(purpose="a job that asks Slurm for --gpus-per-task"), _FIX],
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
            f"{tasks * gpus} (one per GPU), not {world}",
            remedies=[_UNSET_WORLD_SIZE, _FIX],
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
