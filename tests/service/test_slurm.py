"""The Slurm TaskProlog (deploy/slurm/prolog.sh) on a real one-node Slurm (tests/helpers/slurm.py:
8 simulated GPUs), asking a real autobatch service on 127.0.0.1 that holds a measured profile.
Jobs go through sbatch and srun; each task prints the AUTOBATCH_* variables the prolog gave it
and the library's reading of its launcher, and the plan is checked there: one task per GPU,
one torchrun per node (real torchrun, its ranks reading their layout), and many tasks of many
jobs planning at once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from autobatch.client import publish_profile
from autobatch.conditions import Conditions
from tests.helpers.slurm import Cluster, one_node_cluster
from tests.service.serving import Server, serving
from tests.service.test_service_api import make_profile

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "9c1e5b0f7a3d2e48"
CARD = "NVIDIA H100 80GB HBM3"
JOB_TIMEOUT_S = 180
# Each task writes its AUTOBATCH_* variables, then the library's reading inside the task.
REPORT = (
    'env | grep "^AUTOBATCH_" | sort > "$OUT/$SLURM_JOB_ID.$SLURM_PROCID.env"; '
    'autobatch launcher >> "$OUT/$SLURM_JOB_ID.$SLURM_PROCID.env"'
)


@pytest.fixture(scope="module")
def cluster_and_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, Server]]:
    root = tmp_path_factory.mktemp("slurm")
    prolog = root / "taskprolog.sh"
    prolog.write_text(f"#!/bin/sh\nexec sh {ROOT}/deploy/slurm/prolog.sh\n")
    prolog.chmod(0o755)
    with (
        one_node_cluster(root / "cluster", task_prolog=prolog) as cluster,
        serving(root) as server,
    ):
        # The node measured 36 as its recommended micro-batch on this card (max 40).
        profile = make_profile(
            model_fingerprint=FINGERPRINT,
            device_name=CARD,
            node_name="localhost",
            conditions=Conditions(device_type="cuda", amp_dtype="bfloat16"),
        )
        publish_profile(f"http://127.0.0.1:{server.port}", profile)
        yield cluster, server


def job_env(cluster: Cluster, server: Server, out: Path) -> dict[str, str]:
    """What sbatch/srun export to the tasks (and so to their TaskProlog)."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        **cluster.env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(ROOT),
        "AUTOBATCH_CENTRAL_URL": f"http://127.0.0.1:{server.port}",
        "AUTOBATCH_MODEL_FINGERPRINT": FINGERPRINT,
        "AUTOBATCH_EFFECTIVE_BATCH_SIZE": "256",
        "AUTOBATCH_CARD": CARD,
        "AUTOBATCH_PLAN_DIR": str(out),
        "OUT": str(out),
    }


def reports(out: Path) -> dict[str, dict[str, str]]:
    """Each task's variables (and its ``launcher`` line), by ``<job>.<task>``."""
    found = {}
    for path in sorted(out.glob("*.env")):
        if path.name.startswith("plan-"):
            continue
        lines = path.read_text().splitlines()
        variables = dict(line.split("=", 1) for line in lines if line.startswith("AUTOBATCH_"))
        variables["launcher"] = next(line for line in lines if " rank" in line)
        found[path.name.removesuffix(".env")] = variables
    return found


def run(command: list[str], env: dict[str, str], cluster: Cluster) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stderr}\n{cluster.log()}"
    return done.stdout


def test_one_task_per_gpu_plans_for_every_task(
    cluster_and_service: tuple[Cluster, Server], tmp_path: Path
) -> None:
    cluster, server = cluster_and_service
    env = job_env(cluster, server, tmp_path)
    run(["srun", "-n8", "--ntasks-per-node=8", "--gres=gpu:8", "sh", "-c", REPORT], env, cluster)
    tasks = reports(tmp_path)
    assert len(tasks) == 8
    for task in tasks.values():
        # 256 over 8 ranks: 32 per rank, within the measured 36: 32 x 1.
        assert task["AUTOBATCH_WORLD_SIZE"] == "8", task
        assert task["AUTOBATCH_MICRO_BATCH_SIZE"] == "32"
        assert task["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"] == "1"
        assert "AUTOBATCH_PLAN_ERROR" not in task
        assert task["launcher"].startswith("8 ranks: Slurm job ")
        assert "8 tasks, one rank each" in task["launcher"]
    # All eight wrote the job's one plan file; none left a temporary file behind.
    (job,) = {name.split(".")[0] for name in tasks}
    assert sorted(p.name for p in tmp_path.iterdir() if "plan" in p.name) == [f"plan-{job}.env"]
    assert "export AUTOBATCH_WORLD_SIZE=8\n" in (tmp_path / f"plan-{job}.env").read_text()


def test_one_torchrun_per_node_plans_for_its_gpus(
    cluster_and_service: tuple[Cluster, Server], tmp_path: Path
) -> None:
    """One task holding 4 GPUs runs torchrun with 4 ranks: the prolog plans for 4 (the task
    count says 1), and torchrun's ranks read 4 in the Slurm job."""
    cluster, server = cluster_and_service
    env = job_env(cluster, server, tmp_path)
    (tmp_path / "rank.py").write_text(
        "import os\n"
        "from autobatch.launchers import launcher_layout\n"
        "layout = launcher_layout(os.environ)\n"
        "path = os.path.join(os.environ['OUT'], 'rank%s.txt' % os.environ['RANK'])\n"
        "planned = os.environ['AUTOBATCH_WORLD_SIZE']\n"
        "open(path, 'w').write(f'{layout.world_size} {planned} {layout.source}')\n"
    )
    (tmp_path / "task.sh").write_text(
        f"{REPORT}\nexec {sys.executable} -m torch.distributed.run --standalone "
        f"--nproc-per-node=$AUTOBATCH_WORLD_SIZE {tmp_path / 'rank.py'}\n"
    )
    run(
        ["sbatch", "--wait", "-n1", "--gres=gpu:4", "-o", str(tmp_path / "job.out"),
         "--wrap", f"srun sh {tmp_path / 'task.sh'}"],
        env,
        cluster,
    )  # fmt: skip
    (task,) = reports(tmp_path).values()
    # 256 over 4 ranks: 64 per rank, micro-batches of at most 36: 32 x 2.
    assert task["AUTOBATCH_WORLD_SIZE"] == "4", (tmp_path / "job.out").read_text()
    assert (task["AUTOBATCH_MICRO_BATCH_SIZE"], task["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"]) == (
        "32",
        "2",
    )
    assert "1 tasks x 4 GPUs per task, one rank per GPU" not in task["launcher"]  # inside: one
    assert task["launcher"].startswith("1 rank: Slurm job ")
    ranks = sorted(tmp_path.glob("rank*.txt"))
    assert len(ranks) == 4, (tmp_path / "job.out").read_text()
    for path in ranks:
        world, planned, source = path.read_text().split(" ", 2)
        assert (world, planned) == ("4", "4")
        assert source.startswith("torchrun (WORLD_SIZE=4,") and " in Slurm job " in source


def test_many_tasks_of_many_jobs_plan_at_once(
    cluster_and_service: tuple[Cluster, Server], tmp_path: Path
) -> None:
    """8 jobs of 2 tasks each, submitted together: 16 prologs at once, two per plan file."""
    cluster, server = cluster_and_service
    env = job_env(cluster, server, tmp_path)
    jobs = [
        subprocess.Popen(
            [
                "sbatch",
                "--wait",
                "-n2",
                "-o",
                str(tmp_path / f"job{index}.out"),
                "--wrap",
                f"srun sh -c '{REPORT}'",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for index in range(8)
    ]
    for job in jobs:
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT_S)
        assert job.returncode == 0, f"{stdout}{stderr}\n{cluster.log()}"
    tasks = reports(tmp_path)
    assert len(tasks) == 16
    for name, task in tasks.items():
        assert "AUTOBATCH_PLAN_ERROR" not in task, name
        assert (task["AUTOBATCH_WORLD_SIZE"], task["AUTOBATCH_MICRO_BATCH_SIZE"]) == ("2", "32")
        assert task["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"] == "4"  # 256 / 2 = 128 = 4 x 32
    plans = sorted(p.name for p in tmp_path.iterdir() if "plan" in p.name)
    assert plans == sorted({f"plan-{name.split('.')[0]}.env" for name in tasks})


def test_a_step_of_one_task_inside_an_allocation_of_eight_plans_for_its_gpus(
    cluster_and_service: tuple[Cluster, Server], tmp_path: Path
) -> None:
    """Issue 46: inside ``sbatch --ntasks-per-node=8 --gres=gpu:8``, the usual ``srun --ntasks=1
    torchrun --nproc-per-node=8`` keeps the allocation's ``SLURM_NTASKS_PER_NODE=8`` beside the
    step's one task: the prolog must plan for the step's 8 GPUs (8 ranks: 32 x 1), not divide
    them among the allocation's 8 tasks (world size 1: 32 x 8, 2,048 a step for 256 asked)."""
    cluster, server = cluster_and_service
    env = job_env(cluster, server, tmp_path)
    run(
        ["sbatch", "--wait", "-N1", "--ntasks-per-node=8", "--gres=gpu:8",
         "-o", str(tmp_path / "job.out"),
         "--wrap", f"srun --ntasks=1 --gres=gpu:8 sh -c 'env > $OUT/slurm.txt; {REPORT}'"],
        env,
        cluster,
    )  # fmt: skip
    (task,) = reports(tmp_path).values()
    out = (tmp_path / "job.out").read_text()
    assert "AUTOBATCH_PLAN_ERROR" not in task, out
    assert task["AUTOBATCH_WORLD_SIZE"] == "8", (task, out)
    # The layout is the issue's: the allocation's 8 tasks a node beside the step's one.
    seen = (tmp_path / "slurm.txt").read_text().splitlines()
    assert {"SLURM_NTASKS_PER_NODE=8", "SLURM_STEP_TASKS_PER_NODE=1"} <= set(seen), seen
    assert (task["AUTOBATCH_MICRO_BATCH_SIZE"], task["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"]) == (
        "32",
        "1",
    )
