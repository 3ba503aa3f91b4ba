"""Each launcher's reading, innermost first, and the one rule that picks and checks it
(:func:`launcher_layout`)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from autobatch.errors import ConfigError, Remedy
from autobatch.launchers._common import (
    _FIX,
    _TORCH_NAMES,
    _UNSET_WORLD_SIZE,
    LauncherLayout,
    SlurmTaskRanks,
    _inside,
    _int,
    _said,
    _world_size_is,
)
from autobatch.launchers._slurm import _slurm, _slurm_step_tasks


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
    if local is not None and groups is None and world % local:
        raise ConfigError(
            f"torchrun's variables disagree: LOCAL_WORLD_SIZE={local} ranks per node do not "
            f"divide WORLD_SIZE={world} ranks into whole nodes",
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


_FIXED_RANGE = re.compile(r"([1-9]\d*):\1$")  # "2:2": torchrun --nnodes=2:2 is --nnodes=2


def _kubeflow(environ: Mapping[str, str]) -> LauncherLayout | None:
    """A Kubeflow pod before torchrun runs: PyTorchJob and TrainJob set ``PET_NNODES`` (pods),
    ``PET_NPROC_PER_NODE`` (ranks per pod) and ``PET_NODE_RANK``, which torchrun reads as its
    flags. PyTorchJob also sets ``WORLD_SIZE``, to the number of pods (or, in newer operators,
    pods x ``nprocPerNode``); the ranks are ``PET_NNODES`` x ``PET_NPROC_PER_NODE``."""
    if "PET_NNODES" not in environ or "PET_NPROC_PER_NODE" not in environ:
        return None
    said = _said(environ, ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "WORLD_SIZE"))
    fixed = _FIXED_RANGE.match(environ["PET_NNODES"].strip())
    try:
        nodes = int(fixed[1]) if fixed else _int(environ, "PET_NNODES")
        per_node = _int(environ, "PET_NPROC_PER_NODE")
    except ConfigError:
        # An elastic range (PET_NNODES=1:4, min < max) or PET_NPROC_PER_NODE=auto/gpu:
        # torchrun settles the size at rendezvous, after this process reads it.
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
    (``PET_*``; beside a Slurm step, the two are compared), a Slurm step, a bare ``WORLD_SIZE``.
    Whichever reads it, the rank must lie within the ranks that reading counts.

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
            Kubeflow's ``PET_*``, Slurm's tasks and GPUs, or an MPI size; torchrun's
            ``LOCAL_WORLD_SIZE`` that does not divide its ``WORLD_SIZE``; Kubeflow's ranks
            beside a Slurm step's other count), or a rank (local rank) is at or beyond the
            ranks (on this node) its reading counts; the message names the variables, their
            values and the fix (``world_size=N``).
    """
    layout = (
        _torchrun(environ)
        or _deepspeed(environ)
        or _mpi(environ)
        or _kubeflow_in_slurm(environ, slurm_task_ranks)
        or _slurm(environ, slurm_task_ranks)
        or _world_size(environ)
    )
    if layout is not None:
        _rank_within(layout)
    return layout


def _kubeflow_in_slurm(
    environ: Mapping[str, str], task_ranks: SlurmTaskRanks
) -> LauncherLayout | None:
    """Kubeflow's reading (``PET_*``), compared with the Slurm step's where both are set: the
    step's tasks were started by ``srun`` (the inner launcher) and the pod's variables were
    inherited, or a pod's torchrun runs inside the step; the environment cannot say which
    counts the ranks, so two counts that differ are refused naming both; equal, the step's
    reading (the innermost) is returned.

    Raises:
        ConfigError: the Kubeflow pod's ranks differ from the Slurm step's.
    """
    kubeflow = _kubeflow(environ)
    slurm = _slurm(environ, task_ranks) if "SLURM_STEP_ID" in environ else None
    if kubeflow is None or slurm is None:
        return kubeflow
    if slurm.world_size == kubeflow.world_size:
        return slurm
    raise ConfigError(
        f"{kubeflow.source} make {kubeflow.world_size} ranks, but {slurm.source} makes "
        f"{slurm.world_size}: a Slurm step inside a Kubeflow pod (or a pod's variables inherited "
        "by a step) counts other processes, and the environment cannot say which started the "
        "ranks",
        remedies=[
            _world_size_is(kubeflow.world_size, "if torchrun reads the pod's PET_* variables"),
            _world_size_is(slurm.world_size, "if srun's tasks are the ranks"),
        ],
    )


def _rank_within(layout: LauncherLayout) -> None:
    """Refuse a rank (or local rank) at or beyond the ranks the same reading counts: the
    environment holds another job's variables, or two launchers' (every launcher's reading
    passes here).

    Raises:
        ConfigError: ``rank >= world_size``, or ``local_rank >= ranks_per_node``.
    """
    for what, index, count, counted in (
        ("rank", layout.rank, layout.world_size, "ranks"),
        ("local rank", layout.local_rank, layout.ranks_per_node, "ranks on this node"),
    ):
        if index is not None and count is not None and index >= count:
            raise ConfigError(
                f"{layout.source} puts this process at {what} {index}, beyond its own {count} "
                f"{counted} (0 to {count - 1}): the environment holds another job's or another "
                "launcher's variables",
                remedies=[Remedy(purpose="an environment with one launcher's variables"), _FIX],
            )
