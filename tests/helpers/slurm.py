"""A real one-node Slurm cluster for tests: Debian's ``slurm-wlm`` and ``munge`` started in a
temporary directory (munged with a generated key, slurmctld and slurmd with a generated
slurm.conf), as root with ``SlurmUser=root``, no cgroups, no accounting.

With ``submit_config`` the controller runs autobatch's Lua plugins (``JobSubmitPlugins=lua``,
``CliFilterPlugins=lua``): deploy/slurm's job_submit.lua, cli_filter.lua and
autobatch_admission.lua are copied beside slurm.conf, where Slurm looks for them (as Debian's
/etc/slurm/), and ``AUTOBATCH_SUBMIT_CONFIG`` names the settings file in slurmctld's environment
and in :attr:`Cluster.env` (the clients').

What is simulated: the GPUs. The node declares 8 ``gpu`` GRES backed by empty files (Slurm's
gpu plugin drops file-less GPUs), so Slurm allocates and counts them and sets
``SLURM_GPUS_ON_NODE`` as it does on a GPU node; there is no CUDA device behind them. Everything
else (srun, sbatch, the TaskProlog, the task environment) is Slurm's own.

``AUTOBATCH_TEST_SLURM=required`` (``.ci/run`` sets it) turns a missing binary or a non-root
user into a failure instead of a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service.serving import free_port

ENV_VAR = "AUTOBATCH_TEST_SLURM"
LUA_PLUGINS = ("job_submit.lua", "cli_filter.lua", "autobatch_admission.lua")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
NUM_GPUS = 8
NUM_CPUS = 32  # declared, not real (config_overrides): enough slots for concurrent jobs
START_TIMEOUT_S = 60.0


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here; None when it can."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return f"Slurm binaries missing: {', '.join(missing)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root (SlurmUser=root)"
    return None


def skip_or_fail_without_slurm() -> None:
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get(ENV_VAR) == "required":
        pytest.fail(f"{ENV_VAR}=required but {reason}")
    pytest.skip(reason)


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    """The environment a client (sbatch, srun) needs: SLURM_CONF."""

    def log(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted((self.root / "log").glob("*.log"))
        )


def _slurm_conf(root: Path, *, task_prolog: Path, plugins: bool) -> str:
    lua = "JobSubmitPlugins=lua\nCliFilterPlugins=lua\n" if plugins else ""
    return f"""{lua}\
ClusterName=autobatchtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
TaskProlog={task_prolog}
NodeName=localhost NodeAddr=127.0.0.1 CPUs={NUM_CPUS} Gres=gpu:{NUM_GPUS} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _daemon(stack: ExitStack, command: list[str], log: Path, env: dict[str, str]) -> None:
    """Start a daemon in the foreground of a child process, stopped (then killed) at exit."""
    out = stack.enter_context(log.open("ab"))
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    stack.callback(stop)


def _wait_idle(cluster: Cluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=cluster.env, capture_output=True, text=True
        ).stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    pytest.fail(f"the Slurm node did not come up (state {state!r}):\n{cluster.log()}")


@contextmanager
def one_node_cluster(
    root: Path, *, task_prolog: Path, submit_config: Path | None = None
) -> Iterator[Cluster]:
    """munged, slurmctld and slurmd under ``root``, the node idle with 8 (simulated) GPUs and
    ``task_prolog`` as its TaskProlog, and with ``submit_config`` autobatch's Lua plugins
    reading that settings file; every daemon stopped at exit."""
    skip_or_fail_without_slurm()
    for name in ("state", "spool", "log", "dev"):
        (root / name).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for index in range(NUM_GPUS):
        (root / "dev" / f"gpu{index}").touch()
    (root / "gres.conf").write_text(f"NodeName=localhost Name=gpu File={root}/dev/gpu[0-7]\n")
    plugins = submit_config is not None
    (root / "slurm.conf").write_text(_slurm_conf(root, task_prolog=task_prolog, plugins=plugins))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    if submit_config is not None:
        for name in LUA_PLUGINS:
            shutil.copyfile(DEPLOY / name, root / name)
        env["AUTOBATCH_SUBMIT_CONFIG"] = str(submit_config)
    cluster = Cluster(root=root, env=env)
    with ExitStack() as stack:
        _daemon(
            stack,
            ["munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={root}/munge.sock", f"--pid-file={root}/munged.pid",
             f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge.seed"],
            root / "log" / "munged.out.log",
            env,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (root / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        _daemon(stack, ["slurmctld", "-D", "-i"], root / "log" / "slurmctld.out.log", env)
        _daemon(stack, ["slurmd", "-D", "-N", "localhost"], root / "log" / "slurmd.out.log", env)
        _wait_idle(cluster)
        yield cluster
