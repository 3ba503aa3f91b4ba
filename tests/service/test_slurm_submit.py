"""autobatch's Slurm plugins (deploy/slurm/job_submit.lua in slurmctld, cli_filter.lua in the
clients) on a real one-node Slurm (tests/helpers/slurm.py: 8 simulated GPUs), asking a real
``autobatch serve`` that holds a measured profile (recommended micro-batch 36 on the H100).

Jobs go through sbatch: a reachable batch runs with the plan decided at submission in its
environment and in the prolog's file; an unreachable one fails at sbatch naming the nearest
batches; a job asking to be sized gets the plan's GPU count; a job naming no model is left
alone; and with the service stopped, frozen (SIGSTOP) or slow, jobs go in within the bound."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from autobatch.client import publish_profile
from autobatch.conditions import Conditions
from autobatch.profile import Trial
from tests.helpers.fake_pynvml import GiB
from tests.helpers.slurm import ENV_VAR, Cluster, one_node_cluster, skip_or_fail_without_slurm
from tests.service.serving import Server, free_port, serving
from tests.service.test_service_api import make_profile

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "9c1e5b0f7a3d2e48"
CARD = "NVIDIA H100 80GB HBM3"
TIMEOUT_S = 1.0
"""The plugins' bound per decision in these tests (the default is 2 s)."""
SLACK_S = 4.0
"""What sbatch itself may take beyond the bound on 2 shared cores (its own start, munge, the
controller's RPC)."""
JOB_TIMEOUT_S = 120
LUA_MODULES = ("/usr/share/lua/5.1/socket/http.lua", "/usr/lib/x86_64-linux-gnu/lua/5.1/cjson.so")
REPORT = (
    'env | grep "^AUTOBATCH_" | sort > "$OUT/$SLURM_JOB_ID.env"; '
    'echo "$SLURM_GPUS_ON_NODE" > "$OUT/$SLURM_JOB_ID.gpus"'
)


@dataclass
class Site:
    cluster: Cluster
    server: Server
    config: Path

    def configure(self, central_url: str, **settings: str) -> None:
        """The plugins' settings file (read at every decision)."""
        lines = {
            "central_url": central_url,
            "card": CARD,
            "timeout_s": str(TIMEOUT_S),
            "retry_after_s": "0",
            "allowed_gpus": "1,2,4,8",
            **settings,
        }
        self.config.write_text("".join(f"{key} = {value}\n" for key, value in lines.items()))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    skip_or_fail_without_slurm()  # before the server starts
    missing = [path for path in LUA_MODULES if not Path(path).exists()]
    if missing:
        reason = f"lua-socket and lua-cjson missing ({', '.join(missing)})"
        if os.environ.get(ENV_VAR) == "required":
            pytest.fail(f"{ENV_VAR}=required but {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm-submit")
    prolog = root / "taskprolog.sh"
    prolog.write_text(f"#!/bin/sh\nexec sh {ROOT}/deploy/slurm/prolog.sh\n")
    prolog.chmod(0o755)
    config = root / "autobatch.conf"
    with (
        serving(root) as server,
        one_node_cluster(root / "cluster", task_prolog=prolog, submit_config=config) as cluster,
    ):
        profile = make_profile(
            model_fingerprint=FINGERPRINT,
            device_name=CARD,
            node_name="localhost",
            conditions=Conditions(device_type="cuda", amp_dtype="bfloat16"),
        )
        publish_profile(f"http://127.0.0.1:{server.port}", profile)
        found = Site(cluster=cluster, server=server, config=config)
        found.configure(found.url)
        yield found


def submit_env(site: Site, out: Path, **variables: str) -> dict[str, str]:
    """sbatch's environment: the job names its model with ``variables``."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        **site.cluster.env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(ROOT),
        "AUTOBATCH_CENTRAL_URL": site.url,
        "AUTOBATCH_CARD": CARD,
        "AUTOBATCH_PLAN_DIR": str(out),
        "OUT": str(out),
        **variables,
    }


def sbatch(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        ["sbatch", *args], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    return done, time.monotonic() - started


def model(batch: int, **more: str) -> dict[str, str]:
    return {
        "AUTOBATCH_MODEL_FINGERPRINT": FINGERPRINT,
        "AUTOBATCH_EFFECTIVE_BATCH_SIZE": str(batch),
        **more,
    }


def reported(site: Site, out: Path, job: str) -> dict[str, str]:
    """The job's task's AUTOBATCH_* variables, once its task wrote them (polled: faster than
    ``sbatch --wait``'s own polling, which sleeps up to 10 s)."""
    report, gpus = out / f"{job}.env", out / f"{job}.gpus"  # written in this order
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (gpus.exists() and gpus.read_text().endswith("\n")):
        assert time.monotonic() < deadline, site.cluster.log()
        time.sleep(0.1)
    return variables(report)


def variables(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_a_reachable_job_runs_with_the_plan_decided_at_submission(
    site: Site, tmp_path: Path
) -> None:
    env = submit_env(site, tmp_path, **model(256))
    done, _ = sbatch(
        ["-n1", "--gres=gpu:8", "-o", str(tmp_path / "job.out"), "--wrap",
         f"srun sh -c '{REPORT}'"],
        env,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stderr}\n{site.cluster.log()}"
    # The user is told at sbatch (cli_filter's advice, then the controller's decision).
    assert "autobatch (advisory): accepted: effective batch 256 = micro-batch 32 x 1" in done.stderr
    assert (
        "autobatch: accepted: effective batch 256 = micro-batch 32 x 1 accumulation step x 8 "
        "GPUs (measured)" in done.stderr
    )
    job = done.stdout.split()[-1]
    task = reported(site, tmp_path, job)
    assert task["AUTOBATCH_PLAN_AT"] == "submit"
    assert (task["AUTOBATCH_MICRO_BATCH_SIZE"], task["AUTOBATCH_WORLD_SIZE"]) == ("32", "8")
    assert task["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"] == "1"
    assert "AUTOBATCH_PLAN_ERROR" not in task
    # The prolog kept the submission's plan, as it was: the same variables in its file.
    lines = (tmp_path / f"plan-{job}.env").read_text().splitlines()
    kept = dict(shlex.split(line)[1].split("=", 1) for line in lines)
    planned = task["AUTOBATCH_PLAN_VARIABLES"].split(",")
    assert kept == {name: task[name] for name in [*planned, "AUTOBATCH_PLAN_AT"]}
    assert kept["AUTOBATCH_PLAN_CARD"] == CARD
    assert task["AUTOBATCH_PLAN_FILE"] == str(tmp_path / f"plan-{job}.env")


def test_an_unreachable_batch_fails_at_sbatch_naming_the_nearest(
    site: Site, tmp_path: Path
) -> None:
    done, _ = sbatch(["--gres=gpu:8", "--wrap", "true"], submit_env(site, tmp_path, **model(97)))
    assert done.returncode != 0
    assert "autobatch: the job cannot reach its effective batch" in done.stderr
    assert "nearest reachable effective batch sizes: 96, 104" in done.stderr
    assert "GPU counts that reach it: 1" in done.stderr
    assert "Submitted batch job" not in done.stdout


@pytest.mark.parametrize("ranks", ["eight", "2.5", "0"])
def test_a_world_size_that_is_not_a_count_is_named_not_replaced_by_the_gpus(
    site: Site, tmp_path: Path, ranks: str
) -> None:
    """AUTOBATCH_JOB_WORLD_SIZE=eight was planned as the job's 8 GPUs, silently: it is named,
    and nothing is decided (the job goes in as asked, as for a batch that is not a number)."""
    env = submit_env(site, tmp_path, **model(256, AUTOBATCH_JOB_WORLD_SIZE=ranks))
    done, _ = sbatch(["--gres=gpu:8", "-o", str(tmp_path / "job.out"), "--wrap", "true"], env)
    assert done.returncode == 0, f"{done.stderr}\n{site.cluster.log()}"
    said = f"AUTOBATCH_JOB_WORLD_SIZE={ranks} is not a whole number of ranks"
    assert f"autobatch (advisory): {said}" in done.stderr  # cli_filter, at sbatch
    assert f"autobatch: {said}" in done.stderr  # job_submit, in slurmctld
    assert "nothing decided" in done.stderr
    assert "accepted" not in done.stderr
    assert "Submitted batch job" in done.stdout
    assert f"job_submit/lua autobatch: nothing decided: {said}" in site.cluster.log()


def test_a_job_asking_to_be_sized_gets_the_plans_gpu_count(site: Site, tmp_path: Path) -> None:
    # The job asks for 8 GPUs; one reaches 512 (32 x 16 accumulation steps): the fewest.
    env = submit_env(site, tmp_path, **model(512, AUTOBATCH_SIZE_GPUS="1"))
    done, _ = sbatch(
        ["-n1", "--gres=gpu:8", "-o", str(tmp_path / "job.out"), "--wrap",
         f"srun sh -c '{REPORT}'"],
        env,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stderr}\n{site.cluster.log()}"
    assert "autobatch: sized to 1 GPU" in done.stderr
    job = done.stdout.split()[-1]
    assert reported(site, tmp_path, job)["AUTOBATCH_WORLD_SIZE"] == "1"
    assert (tmp_path / f"{job}.gpus").read_text().strip() == "1"


def test_a_job_naming_no_model_is_left_alone(site: Site, tmp_path: Path) -> None:
    env = submit_env(site, tmp_path)
    done, _ = sbatch(
        ["-n1", "--gres=gpu:2", "-o", str(tmp_path / "job.out"), "--wrap",
         f"srun sh -c '{REPORT}'"],
        env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "autobatch" not in done.stderr
    job = done.stdout.split()[-1]
    assert reported(site, tmp_path, job).get("AUTOBATCH_PLAN_AT") is None
    assert (tmp_path / f"{job}.gpus").read_text().strip() == "2"


@pytest.fixture
def slow_server() -> Iterator[str]:
    """A server that accepts, reads, and answers nothing for 30 s."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        held = []
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(connection)
        for connection in held:
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    listener.close()


@pytest.mark.parametrize("failure", ["stopped", "frozen", "slow"])
def test_without_the_service_jobs_go_in_unchanged_within_the_bound(
    site: Site, tmp_path: Path, failure: str, slow_server: str
) -> None:
    url = {"stopped": f"http://127.0.0.1:{free_port()}", "slow": slow_server}.get(failure, site.url)
    site.configure(url)
    batch = {"stopped": 128, "frozen": 64, "slow": 32}[failure]  # not in the plugins' cache
    env = submit_env(site, tmp_path, **model(batch))
    if failure == "frozen":
        site.server.process.send_signal(signal.SIGSTOP)
    try:
        done, seconds = sbatch(["--hold", "--gres=gpu:4", "--wrap", "true"], env)
    finally:
        if failure == "frozen":
            site.server.process.send_signal(signal.SIGCONT)
        site.configure(site.url)
    assert done.returncode == 0, done.stderr
    job = done.stdout.split()[-1]
    subprocess.run(["scancel", job], env=site.cluster.env, check=True)
    assert "autobatch: no plan at submission" in done.stderr
    assert "the job goes in unchanged" in done.stderr
    # cli_filter's advice and the controller's decision: each within the bound.
    assert seconds < 2 * TIMEOUT_S + SLACK_S, (seconds, done.stderr)
    assert "no decision: " in Path(site.cluster.root / "log" / "slurmctld.log").read_text()


def test_a_cached_answer_holds_while_the_service_is_frozen(site: Site, tmp_path: Path) -> None:
    env = submit_env(site, tmp_path, **model(1024))
    first, _ = sbatch(["--hold", "--gres=gpu:8", "--wrap", "true"], env)
    assert "autobatch: accepted: effective batch 1024 = micro-batch 32 x 4" in first.stderr
    site.configure(site.url, advice="off")  # cli_filter keeps no cache: the controller's alone
    site.server.process.send_signal(signal.SIGSTOP)
    try:
        again, seconds = sbatch(["--hold", "--gres=gpu:8", "--wrap", "true"], env)
    finally:
        site.server.process.send_signal(signal.SIGCONT)
        site.configure(site.url)
    jobs = [first.stdout.split()[-1], again.stdout.split()[-1]]
    subprocess.run(["scancel", *jobs], env=site.cluster.env, check=True)
    assert again.stderr == first.stderr.split("\n", 1)[1]  # the same decision, no advice
    assert seconds < TIMEOUT_S + SLACK_S


def test_fail_closed_refuses_and_a_broken_file_changes_nothing(site: Site, tmp_path: Path) -> None:
    env = submit_env(site, tmp_path, **model(2048))
    site.configure(f"http://127.0.0.1:{free_port()}", on_failure="closed")
    try:
        refused, _ = sbatch(["--hold", "--gres=gpu:8", "--wrap", "true"], env)
        # A file that is not settings: its lines are logged and ignored, the rest holds.
        site.config.write_text(f"central_url = {site.url}\n}}{{ not a setting\ntimeout_s = x\n")
        broken, _ = sbatch(["--hold", "--gres=gpu:8", "--wrap", "true"], env)
    finally:
        site.configure(site.url)
    assert refused.returncode != 0
    assert "autobatch: the job is refused: no plan could be decided at submission" in refused.stderr
    assert broken.returncode == 0, broken.stderr
    subprocess.run(["scancel", broken.stdout.split()[-1]], env=site.cluster.env, check=True)
    # No card in the file: the model's profile drawn among the nodes answers (2048 on 8 = 32 x 8).
    assert "autobatch: accepted: effective batch 2048 = micro-batch 32 x 8" in broken.stderr
    log = (site.cluster.root / "log" / "slurmctld.log").read_text()
    assert "timeout_s = x is not a number of seconds or GPUs (ignored)" in log


def test_srun_and_salloc_get_the_advice(site: Site, tmp_path: Path) -> None:
    env = submit_env(site, tmp_path, **model(97))
    done = subprocess.run(
        ["srun", "-n1", "--gres=gpu:8", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    # Advice only: the job runs (srun's jobs carry no environment to the controller's plugin;
    # the TaskProlog plans them).
    assert done.returncode == 0, done.stderr
    assert "autobatch (advisory): effective batch cannot be reached on 8 GPUs" in done.stderr
    assert "nearest reachable effective batch sizes: 96, 104" in done.stderr


@pytest.mark.parametrize(
    "asked", ["--gpus=4", "--gpus-per-node=4", "--gres=gpu:4", "--gpus-per-task=2 -n2"]
)
def test_every_way_of_asking_for_gpus_is_read(site: Site, tmp_path: Path, asked: str) -> None:
    env = submit_env(site, tmp_path, **model(4096))
    done, _ = sbatch(["--hold", *asked.split(), "--wrap", "true"], env)
    assert done.returncode == 0, done.stderr
    subprocess.run(["scancel", done.stdout.split()[-1]], env=site.cluster.env, check=True)
    # 4096 on 4 GPUs: 1024 each, 32 x 32 steps.
    assert "autobatch: accepted: effective batch 4096 = micro-batch 32 x 32 accumulation " in (
        done.stderr
    )
    assert "x 4 GPUs (measured)" in done.stderr


def test_a_profile_published_after_submission_changes_nothing(site: Site, tmp_path: Path) -> None:
    """The job runs the plan it was told at sbatch, though a smaller profile of its model came
    between submission and start (which the TaskProlog alone would now plan from)."""
    fingerprint = "5b0f7a3d2e489c1e"  # a model of its own: the other tests' plans stay
    first = make_profile(model_fingerprint=fingerprint, device_name=CARD, node_name="localhost")
    first_id = publish_profile(site.url, first)
    env = submit_env(
        site,
        tmp_path,
        AUTOBATCH_MODEL_FINGERPRINT=fingerprint,
        AUTOBATCH_EFFECTIVE_BATCH_SIZE="256",
    )
    done, _ = sbatch(
        ["--hold", "-n1", "--gres=gpu:8", "-o", str(tmp_path / "job.out"), "--wrap",
         f"srun sh -c '{REPORT}'"],
        env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = done.stdout.split()[-1]
    smaller = make_profile(
        model_fingerprint=fingerprint,
        device_name=CARD,
        node_name="other-node",
        max_micro_batch_size=20,
        recommended_micro_batch_size=16,
        trials=(
            Trial(micro_batch_size=1, fits=True, peak_allocated_bytes=3 * GiB, warm_up=True),
            Trial(micro_batch_size=16, fits=True, peak_allocated_bytes=12 * GiB),
            Trial(micro_batch_size=24, fits=False, oom=True, error="OutOfMemoryError"),
        ),
    )
    publish_profile(site.url, smaller)
    now = site.server.client.post(
        "/v1/plan",
        json={"model_fingerprint": fingerprint, "card": CARD, "effective_batch_size": 256,
              "world_size": 8},
    )  # fmt: skip
    assert now.json()["plan"]["micro_batch_size"] == 16  # the most conservative now answers
    subprocess.run(["scontrol", "release", job], env=site.cluster.env, check=True)
    task = reported(site, tmp_path, job)
    assert (task["AUTOBATCH_MICRO_BATCH_SIZE"], task["AUTOBATCH_PLAN_AT"]) == ("32", "submit")
    assert task["AUTOBATCH_PROFILE_ID"] == first_id != now.json()["profile_id"]
    assert "export AUTOBATCH_MICRO_BATCH_SIZE=32\n" in (tmp_path / f"plan-{job}.env").read_text()
