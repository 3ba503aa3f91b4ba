"""The launcher's environment read into a world size and a per-node layout: each launcher the
docs name (docs/launchers.md), each layout, and each disagreement refused by name. The variables
are what each launcher sets, per its documentation (the Slurm ones also as a real slurmd sets
them: tests/service/test_slurm.py)."""

from __future__ import annotations

import pytest

from autobatch.conditions import launcher_world_size
from autobatch.errors import ConfigError
from autobatch.launchers import SlurmTaskRanks, launcher_layout

TORCHRUN_2x8_RANK_11 = {
    "WORLD_SIZE": "16", "RANK": "11", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "11", "ROLE_WORLD_SIZE": "16",
    "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
}  # fmt: skip
SLURM_STEP = {"SLURM_JOB_ID": "908", "SLURM_STEP_ID": "0"}
SLURM_PER_GPU_2x8_TASK_9 = {
    **SLURM_STEP, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_GPUS_ON_NODE": "8",
}  # fmt: skip
SLURM_TORCHRUN_PER_NODE = {
    **SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_GPUS_ON_NODE": "8",
}  # fmt: skip
PYTORCHJOB_POD = {  # one pod, torchrun inside it starts 2 ranks: WORLD_SIZE counts the pod
    "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
    "PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0",
}  # fmt: skip
TRAINJOB_NODE = {
    "PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2",
    "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400",
}  # fmt: skip

# (case, environ, slurm_task_ranks, (world_size, nodes, ranks_per_node, rank, local_rank),
#  words the source must hold)
CASES: list[tuple[str, dict[str, str], SlurmTaskRanks, tuple[object, ...], list[str]]] = [
    ("no launcher", {"HOME": "/root"}, "one", (), []),
    (
        "torchrun, 2 nodes x 8",
        TORCHRUN_2x8_RANK_11,
        "one",
        (16, 2, 8, 11, 3),
        ["torchrun (WORLD_SIZE=16, RANK=11, LOCAL_RANK=3, LOCAL_WORLD_SIZE=8, GROUP_WORLD_SIZE=2)"],
    ),
    (
        "torchrun without GROUP_WORLD_SIZE",
        {
            "WORLD_SIZE": "4",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
        },
        "one",
        (4, 2, 2, 0, 0),
        ["torchrun ("],
    ),  # fmt: skip
    (
        "accelerate launch runs torchrun",
        {**TORCHRUN_2x8_RANK_11, "ACCELERATE_MIXED_PRECISION": "bf16"},
        "one",
        (16, 2, 8, 11, 3),
        ["accelerate launch (torchrun) (WORLD_SIZE=16"],
    ),
    (
        "torchrun per node inside Slurm: torchrun's count, in the job",
        {**SLURM_TORCHRUN_PER_NODE, **TORCHRUN_2x8_RANK_11},
        "one",
        (16, 2, 8, 11, 3),
        ["torchrun (WORLD_SIZE=16", "in Slurm job 908"],
    ),
    (
        "torchrun in a Kubeflow pod: torchrun's count, not the pod's WORLD_SIZE",
        {
            **PYTORCHJOB_POD,
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "LOCAL_RANK": "1",
            "RANK": "1",
            "TORCHELASTIC_RUN_ID": "job",
        },
        "one",
        (2, 1, 2, 1, 1),
        ["torchrun (WORLD_SIZE=2", "in a Kubeflow pod"],
    ),  # fmt: skip
    (
        "Kubeflow PyTorchJob pod before torchrun: WORLD_SIZE counts pods",
        PYTORCHJOB_POD,
        "one",
        (2, 1, 2, None, None),
        ["Kubeflow, 1 pods x 2 ranks", "WORLD_SIZE=1 counts pods (PyTorchJob)"],
    ),
    (
        "Kubeflow PyTorchJob (newer operator): WORLD_SIZE = pods x nprocPerNode",
        {**PYTORCHJOB_POD, "PET_NNODES": "2", "WORLD_SIZE": "4"},
        "one",
        (4, 2, 2, None, None),
        [
            "Kubeflow, 2 pods x 2 ranks (PET_NNODES=2, PET_NPROC_PER_NODE=2, PET_NODE_RANK=0, "
            "WORLD_SIZE=4)"
        ],
    ),  # fmt: skip
    ("Kubeflow TrainJob node", TRAINJOB_NODE, "one", (32, 4, 8, None, None), ["4 pods x 8"]),
    (
        "PyTorchJob, one process per pod (no PET_*)",
        {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "job-master-0"},
        "one",
        (3, None, None, 2, None),
        ["the launcher's environment (WORLD_SIZE=3, RANK=2)"],
    ),
    (
        "DeepSpeed launcher, hostfile of 2 nodes x 4",
        {
            "WORLD_SIZE": "8",
            "RANK": "5",
            "LOCAL_RANK": "1",
            "LOCAL_SIZE": "4",
            "CROSS_RANK": "1",
            "CROSS_SIZE": "2",
            "MASTER_ADDR": "worker-0",
        },
        "one",
        (8, 2, 4, 5, 1),
        ["the DeepSpeed launcher (WORLD_SIZE=8, RANK=5, LOCAL_RANK=1, LOCAL_SIZE=4, CROSS_SIZE=2)"],
    ),  # fmt: skip
    (
        "mpirun (Open MPI)",
        {
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        },
        "one",
        (8, None, 4, 6, 2),
        ["mpirun (Open MPI) (OMPI_COMM_WORLD_SIZE=8"],
    ),  # fmt: skip
    (
        "mpirun (Open MPI) with the WORLD_SIZE Accelerate copies from it",
        {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "WORLD_SIZE": "4"},
        "one",
        (4, None, None, 1, None),
        ["mpirun (Open MPI)"],
    ),
    (
        "mpiexec (MPICH / Intel MPI, Hydra)",
        {"PMI_SIZE": "6", "PMI_RANK": "5", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"},
        "one",
        (6, None, 3, 5, 2),
        ["mpirun (MPICH or Intel MPI) (PMI_SIZE=6, PMI_RANK=5"],
    ),
    (
        "srun --mpi=pmi2 sets PMI_SIZE too: read as Slurm's",
        {**SLURM_PER_GPU_2x8_TASK_9, "PMI_SIZE": "16", "PMI_RANK": "9"},
        "one",
        (16, 2, 8, 9, 1),
        ["Slurm job 908: 16 tasks, one rank each"],
    ),
    (
        "Slurm, one task per GPU, in a task",
        SLURM_PER_GPU_2x8_TASK_9,
        "one",
        (16, 2, 8, 9, 1),
        ["Slurm job 908: 16 tasks, one rank each (SLURM_NTASKS=16"],
    ),
    (
        "Slurm, one task per GPU, in its TaskProlog: the same",
        SLURM_PER_GPU_2x8_TASK_9,
        "gpus",
        (16, 2, 8, 9, 1),
        ["16 tasks, one rank each"],
    ),
    (
        "Slurm, one torchrun per node, in its TaskProlog: nodes x GPUs",
        SLURM_TORCHRUN_PER_NODE,
        "gpus",
        (16, 2, 8, None, None),
        ["Slurm job 908: 2 tasks x 8 GPUs per task, one rank per GPU"],
    ),
    (
        "Slurm, one task per node with 8 GPUs, in the task: one rank per task",
        SLURM_TORCHRUN_PER_NODE,
        "one",
        (2, 2, 1, 1, 0),
        ["2 tasks, one rank each (each holds 8 GPUs"],
    ),
    (
        "Slurm, --gpus-per-task=4 (typed), 2 tasks per node",
        {
            **SLURM_STEP,
            "SLURM_NTASKS": "4",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_NNODES": "2",
            "SLURM_GPUS_PER_TASK": "a100:4",
        },
        "gpus",
        (16, 2, 8, None, None),
        ["4 tasks x 4 GPUs per task"],
    ),  # fmt: skip
    (
        # node 0: 2 tasks x 2 GPUs, node 1: 1 task x 4 GPUs; 8 ranks read on either node
        "Slurm, --gpus-per-node, uneven tasks per node read on node 1",
        {
            **SLURM_STEP,
            "SLURM_NTASKS": "3",
            "SLURM_TASKS_PER_NODE": "2,1",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_GPUS_PER_NODE": "4",
        },
        "gpus",
        (8, 2, 4, None, None),
        ["3 tasks sharing their nodes' GPUs, one rank per GPU"],
    ),  # fmt: skip
    (
        "Slurm, --gpus-per-node, uneven tasks per node read on node 0",
        {
            **SLURM_STEP,
            "SLURM_NTASKS": "3",
            "SLURM_TASKS_PER_NODE": "2,1",
            "SLURM_NODEID": "0",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_GPUS_PER_NODE": "4",
        },
        "gpus",
        (8, 2, 4, None, None),
        ["3 tasks sharing their nodes' GPUs, one rank per GPU"],
    ),  # fmt: skip
    (
        "Slurm without GPUs: one rank per task either way",
        {**SLURM_STEP, "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "2"},
        "gpus",
        (4, None, None, 2, 2),
        ["4 tasks, one rank each"],
    ),
    (
        "Slurm's batch script, before srun, is one process",
        {"SLURM_JOB_ID": "908", "SLURM_NTASKS": "8", "SLURM_GPUS_ON_NODE": "8"},
        "one",
        (),
        [],
    ),
    (
        "a batch script's own WORLD_SIZE, one per GPU of Slurm's tasks",
        {**SLURM_TORCHRUN_PER_NODE, "WORLD_SIZE": "16", "RANK": "8"},
        "one",
        (16, 2, None, 8, None),
        ["WORLD_SIZE=16, RANK=8, one rank per GPU of Slurm job 908"],
    ),
]


@pytest.mark.parametrize(
    ("environ", "task_ranks", "expected", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_launcher_gives_its_world_size_and_layout(
    environ: dict[str, str],
    task_ranks: SlurmTaskRanks,
    expected: tuple[object, ...],
    words: list[str],
) -> None:
    layout = launcher_layout(environ, slurm_task_ranks=task_ranks)
    if not expected:
        assert layout is None
        assert launcher_world_size(environ, slurm_task_ranks=task_ranks) is None
        return
    assert layout is not None
    got = (layout.world_size, layout.nodes, layout.ranks_per_node, layout.rank, layout.local_rank)
    assert got == expected
    for word in words:
        assert word in layout.source
    assert launcher_world_size(environ, slurm_task_ranks=task_ranks) == (
        layout.world_size,
        layout.source,
    )


REFUSED: list[tuple[str, dict[str, str], SlurmTaskRanks, str]] = [
    (
        "Kubeflow: WORLD_SIZE neither the pods nor the ranks",
        {"WORLD_SIZE": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1"},
        "one",
        r"WORLD_SIZE=1 is neither PET_NNODES=2 \(the pods\) nor PET_NNODES x "
        r"PET_NPROC_PER_NODE=2 \(the ranks\); use world_size=N \(the number of data-parallel "
        r"ranks that train\)$",
    ),
    (
        "Kubeflow, elastic range",
        {"PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "8"},
        "one",
        r"PET_NNODES=1:4, PET_NPROC_PER_NODE=8 leave the number of ranks to torchrun's "
        r"rendezvous \(an elastic range, or a count by device type\); use world_size=N .*, or a "
        r"reading in the processes torchrun starts$",
    ),
    (
        "Kubeflow, nprocPerNode by device type",
        {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "gpu"},
        "one",
        r"PET_NPROC_PER_NODE=gpu leave the number of ranks",
    ),
    (
        "Slurm tasks x GPUs vs WORLD_SIZE",
        {**SLURM_TORCHRUN_PER_NODE, "WORLD_SIZE": "8"},
        "gpus",
        r"WORLD_SIZE=8 disagrees with Slurm job 908: SLURM_NTASKS=2 tasks with 8 GPUs each make "
        r"2 ranks \(one per task\) or 16 \(one per GPU\), not 8; use an environment without "
        r"WORLD_SIZE, or world_size=N",
    ),
    (
        "Slurm GPUs not shared evenly by the node's tasks",
        {
            **SLURM_STEP,
            "SLURM_NTASKS": "3",
            "SLURM_NTASKS_PER_NODE": "3",
            "SLURM_GPUS_ON_NODE": "8",
        },
        "gpus",
        r"Slurm gives this node 8 GPUs .* for 3 tasks, which do not share them evenly.*"
        r"--gpus-per-task, or world_size=N",
    ),  # fmt: skip
    (
        "mpirun vs WORLD_SIZE",
        {"OMPI_COMM_WORLD_SIZE": "4", "WORLD_SIZE": "2"},
        "one",
        r"WORLD_SIZE=2 but OMPI_COMM_WORLD_SIZE=4 \(mpirun \(Open MPI\)\).*; use an environment "
        r"without WORLD_SIZE, or world_size=N",
    ),
    (
        "torchrun's own variables disagree",
        {**TORCHRUN_2x8_RANK_11, "LOCAL_WORLD_SIZE": "4"},
        "one",
        r"WORLD_SIZE=16 but GROUP_WORLD_SIZE=2 nodes x LOCAL_WORLD_SIZE=4 = 8",
    ),
    (
        "DeepSpeed: fewer ranks than on this node",
        {"WORLD_SIZE": "2", "LOCAL_SIZE": "4", "CROSS_SIZE": "1"},
        "one",
        r"WORLD_SIZE=2 is less than LOCAL_SIZE=4",
    ),
    (
        "a count that is not one",
        {**SLURM_STEP, "SLURM_NTASKS": "many"},
        "one",
        r"SLURM_NTASKS 'many' in the environment must be an int >= 1",
    ),
]


@pytest.mark.parametrize(
    ("environ", "task_ranks", "message"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_disagreeing_variables_are_refused_by_name(
    environ: dict[str, str], task_ranks: SlurmTaskRanks, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        launcher_layout(environ, slurm_task_ranks=task_ranks)


def test_autotunes_road_reads_kubeflows_ranks_not_its_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    """The road's resolution (no process group yet) takes the pod's 2 ranks, not WORLD_SIZE=1."""
    import torch

    from autobatch.distributed._layout import resolve_world_size

    for name, value in PYTORCHJOB_POD.items():
        monkeypatch.setenv(name, value)
    world, source = resolve_world_size(torch.nn.Linear(2, 2))
    assert world == 2
    assert "WORLD_SIZE=1 counts pods (PyTorchJob), each running 2 ranks" in source


SLURM_STEP_OF_1_IN_8_PER_NODE = {  # sbatch --ntasks-per-node=8 --gres=gpu:8; srun --ntasks=1
    "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_NTASKS_PER_NODE": "8", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1",
    "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NUM_NODES": "1",
}  # fmt: skip
HYDRA_IN_SLURM_RANK_11 = {  # mpiexec (MPICH/Intel MPI) in a 2-node allocation: srun'd proxies
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
    "PMI_SIZE": "16", "PMI_RANK": "11", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "8",
}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "task_ranks", "expected", "words"),
    [
        pytest.param(
            SLURM_STEP_OF_1_IN_8_PER_NODE,
            "gpus",
            (8, 1, 8, None, None),
            "Slurm job 1: 1 tasks x 8 GPUs per task, one rank per GPU",
            id="a step of 1 task in an allocation of 8 per node, in its TaskProlog: 8 GPUs",
        ),
        pytest.param(
            SLURM_STEP_OF_1_IN_8_PER_NODE,
            "one",
            (1, 1, 1, None, None),
            "Slurm job 1: 1 tasks, one rank each (each holds 8 GPUs",
            id="the same step, inside its one task: one rank (torchrun's variables say more)",
        ),
        pytest.param(
            {**SLURM_STEP_OF_1_IN_8_PER_NODE, "SLURM_STEP_TASKS_PER_NODE": ""},
            "gpus",
            (8, 1, 8, None, None),
            "1 tasks x 8 GPUs per task",
            id="without the step's list, the allocation's 8 per node exceeds the step's 1 task",
        ),
        pytest.param(
            {**HYDRA_IN_SLURM_RANK_11, "PMI_SIZE": "2", "PMI_RANK": "1"},
            "one",
            (2, None, 1, 1, None),
            "Slurm job 7: 2 tasks, one rank each",
            id="srun --mpi=pmi2's PMI_SIZE, equal to the step's tasks: Slurm's reading",
        ),
        pytest.param(
            {**SLURM_STEP_OF_1_IN_8_PER_NODE, "OMPI_COMM_WORLD_SIZE": "1"},
            "one",
            (1, None, None, None, None),
            "mpirun (Open MPI) (OMPI_COMM_WORLD_SIZE=1) in Slurm job 1",
            id="an MPI count equal to the step's tasks: no refusal",
        ),
    ],
)
def test_a_slurm_steps_own_variables_come_before_its_allocations(
    environ: dict[str, str], task_ranks: SlurmTaskRanks, expected: tuple[object, ...], words: str
) -> None:
    layout = launcher_layout(environ, slurm_task_ranks=task_ranks)
    assert layout is not None
    got = (layout.world_size, layout.nodes, layout.ranks_per_node, layout.rank, layout.local_rank)
    assert got == expected
    assert words in layout.source


TWO_LAUNCHERS: list[tuple[str, dict[str, str], str]] = [
    (
        "mpiexec (Hydra) inside a Slurm step of its proxies",
        HYDRA_IN_SLURM_RANK_11,
        r"^mpirun \(MPICH or Intel MPI\) says PMI_SIZE=16 but Slurm job 7's step says "
        r"SLURM_STEP_NUM_TASKS=2: .*; use world_size=16 \(if mpirun started the ranks\), or "
        r"world_size=2 \(if srun started them, one rank per task\)$",
    ),
    (
        "mpirun (Open MPI) inside a Slurm step of its daemons",
        {**SLURM_STEP, "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_SIZE": "16"},
        r"^mpirun \(Open MPI\) says OMPI_COMM_WORLD_SIZE=16 but Slurm job 908's step says "
        r"SLURM_NTASKS=2: ",
    ),
    (
        "mpirun (MVAPICH) inside a Slurm step",
        {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "4", "MV2_COMM_WORLD_SIZE": "8"},
        r"^mpirun \(MVAPICH\) says MV2_COMM_WORLD_SIZE=8 but .* SLURM_STEP_NUM_TASKS=4: ",
    ),
    (
        "a PMIx rank beyond the Slurm step's tasks",
        {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "2", "PMIX_RANK": "5"},
        r"^PMIx says PMIX_RANK=5 but Slurm job 908's step says SLURM_STEP_NUM_TASKS=2: .*; use "
        r"world_size=N",
    ),
    (
        "torchrun with --nnodes=1 in each of a Slurm step's 2 tasks",
        {
            **SLURM_TORCHRUN_PER_NODE,
            **TORCHRUN_2x8_RANK_11,
            "WORLD_SIZE": "8",
            "RANK": "3",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
        },
        r"^torchrun's variables \(WORLD_SIZE=8, RANK=3, LOCAL_RANK=3, LOCAL_WORLD_SIZE=8, "
        r"GROUP_WORLD_SIZE=1\) make 1 torchrun agents \(nodes\), but Slurm job 908's step says "
        r"SLURM_NTASKS=2, one torchrun each: .*; use torchrun --nnodes=2 \(one agent per task\), "
        r"or world_size=8 \(if torchrun's WORLD_SIZE counts every rank that trains\)$",
    ),  # fmt: skip
    (
        "torchrun under mpirun, one per rank, with another count of nodes",
        {**TORCHRUN_2x8_RANK_11, "OMPI_COMM_WORLD_SIZE": "4"},
        r"make 2 torchrun agents \(nodes\), but the MPI launcher says OMPI_COMM_WORLD_SIZE=4, .*; "
        r"use torchrun --nnodes=4 \(one agent per MPI rank\), or world_size=16 ",
    ),
]


@pytest.mark.parametrize(
    ("environ", "message"),
    [case[1:] for case in TWO_LAUNCHERS],
    ids=[case[0] for case in TWO_LAUNCHERS],
)
def test_two_launchers_that_disagree_are_refused_naming_both(
    environ: dict[str, str], message: str
) -> None:
    for task_ranks in ("one", "gpus"):
        with pytest.raises(ConfigError, match=message):
            launcher_layout(environ, slurm_task_ranks=task_ranks)


def test_autotunes_road_refuses_two_launchers_in_pythons_spelling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from autobatch.distributed._layout import resolve_world_size

    for name, value in HYDRA_IN_SLURM_RANK_11.items():
        monkeypatch.setenv(name, value)
    fix = (
        r"; use world_size=16 \(if mpirun started the ranks\), or world_size=2 \(if srun started "
        r"them, one rank per task\)$"
    )
    with pytest.raises(ConfigError, match=fix):
        resolve_world_size(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        pytest.param(
            {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "job-master-0"},
            "the default process group (world size 2, fake); the launcher's environment "
            "(WORLD_SIZE=1, RANK=0) says 1, which counts something else (pods, tasks)",
            id="Kubeflow's per-pod WORLD_SIZE=1 beside the pod's 2-rank group",
        ),
        pytest.param(
            {**HYDRA_IN_SLURM_RANK_11, "PMI_SIZE": "2"},
            "the default process group (world size 2, fake)",
            id="a launcher's count equal to the group's: the group, nothing more to say",
        ),
        pytest.param(
            {**HYDRA_IN_SLURM_RANK_11, "SLURM_STEP_NUM_TASKS": "1"},
            "the default process group (world size 2, fake); the launcher's variables do not "
            "settle a count: mpirun (MPICH or Intel MPI) says PMI_SIZE=16 but Slurm job 7's step "
            "says SLURM_STEP_NUM_TASKS=1",
            id="launchers that disagree beside a group: the group trains",
        ),
    ],
)
def test_an_initialised_group_is_the_one_planned_for_whatever_the_launcher_says(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], words: str
) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autobatch.distributed._layout import resolve_world_size

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        world, source = resolve_world_size(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()
    assert world == 2
    assert source.startswith(words)


def _world_or_refused(environ: dict[str, str], task_ranks: SlurmTaskRanks) -> object:
    try:
        layout = launcher_layout(environ, slurm_task_ranks=task_ranks)
    except ConfigError:
        return "refused"
    assert layout is not None
    return layout.world_size


UNEVEN_STEP = {  # srun over 2 nodes of 2 GPUs: 2 tasks on node 0, 1 on node 1
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_GPUS_ON_NODE": "2",
}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param(UNEVEN_STEP, 4, id="2,1 tasks on 2 GPUs a node: 2 x 1 + 1 x 2"),
        pytest.param({**UNEVEN_STEP, "SLURM_GPUS_ON_NODE": "4"}, 8, id="2 x 2 + 1 x 4"),
        pytest.param(
            {**UNEVEN_STEP, "SLURM_GPUS_ON_NODE": "3"}, "refused", id="3 GPUs for 2 tasks on node 0"
        ),
        pytest.param(
            {
                **UNEVEN_STEP,
                "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
                "SLURM_STEP_NUM_TASKS": "5",
                "SLURM_STEP_NUM_NODES": "3",
            },
            6,
            id="2(x2),1: 2 + 2 + 1 x 2",
        ),
        pytest.param({**UNEVEN_STEP, "SLURM_GPUS_PER_TASK": "2"}, 6, id="--gpus-per-task: 3 x 2"),
    ],
)
def test_every_node_of_one_step_reads_the_same_world_size(
    environ: dict[str, str], expected: object
) -> None:
    """A TaskProlog runs on each node of the step: each must plan for the same world size (or
    each refuse), whichever node's tasks and GPUs it sees."""
    nodes = int(environ["SLURM_STEP_NUM_NODES"])
    readings = {
        _world_or_refused({**environ, "SLURM_NODEID": str(n)}, "gpus") for n in range(nodes)
    }
    assert readings == {expected}


def test_a_node_whose_gpus_its_tasks_cannot_share_is_named_on_every_node() -> None:
    environ = {**UNEVEN_STEP, "SLURM_GPUS_ON_NODE": "3", "SLURM_NODEID": "1"}
    with pytest.raises(
        ConfigError,
        match=r"^Slurm gives a node running 2 of the step's tasks "
        r"\(SLURM_STEP_TASKS_PER_NODE=2,1\) 3 GPUs .* for 2 tasks, which do not share them evenly",
    ):
        launcher_layout(environ, slurm_task_ranks="gpus")


@pytest.mark.parametrize(("world", "local"), [("4", "8"), ("6", "4")])
def test_torchrun_local_world_size_not_dividing_world_size_is_refused(
    world: str, local: str
) -> None:
    env = {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local, "RANK": "0"}
    with pytest.raises(
        ConfigError,
        match=rf"^torchrun's variables disagree: LOCAL_WORLD_SIZE={local} ranks per node do not "
        rf"divide WORLD_SIZE={world} ranks into whole nodes; use world_size=N",
    ):
        launcher_layout(env)


RANK_BEYOND: dict[str, tuple[dict[str, str], str, str]] = {  # environ, what, the variable said
    "torchrun": ({"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                  "GROUP_WORLD_SIZE": "1", "RANK": "9", "LOCAL_RANK": "3"},
                 "rank 9, beyond its own 4 ranks", "RANK=9"),
    "torchrun's local rank": ({"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "8",
                               "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "RANK": "7",
                               "LOCAL_RANK": "7"},
                              "local rank 7, beyond its own 4 ranks on this node", "LOCAL_RANK=7"),
    "bare": ({"WORLD_SIZE": "4", "RANK": "4"}, "rank 4, beyond its own 4 ranks", "RANK=4"),
    "slurm": ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_PROCID": "5"}, "rank 5, beyond its own 2 ranks", "SLURM_PROCID=5"),
    "slurm's WORLD_SIZE per GPU": ({**SLURM_TORCHRUN_PER_NODE, "WORLD_SIZE": "16", "RANK": "16"},
                                   "rank 16, beyond its own 16 ranks", "RANK=16"),
    "openmpi": ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "4"},
                "rank 4, beyond its own 4 ranks", "OMPI_COMM_WORLD_RANK=4"),
    "mvapich": ({"MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_RANK": "6"},
                "rank 6, beyond its own 4 ranks", "MV2_COMM_WORLD_RANK=6"),
    "hydra": ({"PMI_SIZE": "4", "PMI_RANK": "4"}, "rank 4, beyond its own 4 ranks", "PMI_RANK=4"),
    "deepspeed": ({"WORLD_SIZE": "8", "LOCAL_SIZE": "4", "CROSS_SIZE": "2", "RANK": "8"},
                  "rank 8, beyond its own 8 ranks", "RANK=8"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(RANK_BEYOND))
def test_a_rank_beyond_its_world_size_is_refused_for_every_launcher(name: str) -> None:
    """One check for every launcher's reading: the rank (or local rank) it reads must lie
    within the ranks the same reading counts; the message names the variable and its value."""
    environ, what, said = RANK_BEYOND[name]
    with pytest.raises(ConfigError, match=rf"\b{said}\b.* puts this process at {what} "):
        launcher_layout(environ)


def test_the_last_rank_of_its_world_is_read() -> None:
    layout = launcher_layout({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"})
    assert layout is not None and (layout.world_size, layout.rank) == (4, 3)


KUBEFLOW_IN_STEP = {
    "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "3",
}  # fmt: skip


def test_kubeflow_count_beside_a_different_slurm_step_is_refused_naming_both() -> None:
    for task_ranks in ("one", "gpus"):
        with pytest.raises(
            ConfigError,
            match=r"^Kubeflow, 2 pods x 4 ranks \(PET_NNODES=2, PET_NPROC_PER_NODE=4\) make 8 "
            r"ranks, but Slurm job 1: 3 tasks, one rank each .* makes 3: .*; use world_size=8 "
            r"\(if torchrun reads the pod's PET_\* variables\), or world_size=3 \(if srun's tasks "
            r"are the ranks\)$",
        ):
            launcher_layout(KUBEFLOW_IN_STEP, slurm_task_ranks=task_ranks)


def test_kubeflow_count_equal_to_the_slurm_steps_reads_the_step() -> None:
    layout = launcher_layout({**KUBEFLOW_IN_STEP, "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5"})
    assert layout is not None
    assert (layout.world_size, layout.rank) == (8, 5)
    assert layout.source.startswith("Slurm job 1: 8 tasks, one rank each")


def test_kubeflow_outside_a_slurm_step_is_read_beside_a_batch_scripts_variables() -> None:
    """A pod whose image inherits a batch script's SLURM_* (no step) reads the pod alone."""
    no_step = {k: v for k, v in KUBEFLOW_IN_STEP.items() if k != "SLURM_STEP_ID"}
    layout = launcher_layout(no_step)
    assert layout is not None and layout.world_size == 8


@pytest.mark.parametrize(("nnodes", "expected"), [("2:2", 8), ("1:1", 4)])
def test_kubeflow_fixed_range_reads_its_count(nnodes: str, expected: int) -> None:
    layout = launcher_layout({"PET_NNODES": nnodes, "PET_NPROC_PER_NODE": "4"})
    assert layout is not None
    assert (layout.world_size, layout.nodes) == (expected, int(nnodes.split(":")[0]))


@pytest.mark.parametrize("nnodes", ["1:4", "2:1", "0:0", "2:2:2"])
def test_kubeflow_range_that_is_not_one_count_is_still_refused(nnodes: str) -> None:
    with pytest.raises(ConfigError, match=rf"PET_NNODES={nnodes}, .* torchrun's rendezvous"):
        launcher_layout({"PET_NNODES": nnodes, "PET_NPROC_PER_NODE": "4"})
