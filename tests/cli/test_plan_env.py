"""``autobatch plan --env``: export lines or a file from a local plan or a service's answer."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from autobatch.cli import main
from autobatch.cli._plan_env import env_variables
from autobatch.profile import Profile
from tests.planning.test_planner import plan
from tests.service.test_publish import FlakyServer


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sourced(text: str) -> dict[str, str]:
    """What ``sh`` exports after sourcing ``text``."""
    done = subprocess.run(["sh", "-c", f"{text}\nenv -0"], capture_output=True, check=True, env={})
    pairs = (item.partition("=") for item in done.stdout.decode().split("\0") if item)
    return {name: value for name, _, value in pairs if name.startswith("AUTOBATCH_")}


def test_local_plan_as_export_lines(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64", "--env"
    )

    assert (code, err) == (0, "")
    assert sourced(out) == {
        "AUTOBATCH_MICRO_BATCH_SIZE": "16",
        "AUTOBATCH_GRADIENT_ACCUMULATION_STEPS": "4",
        "AUTOBATCH_EFFECTIVE_BATCH_SIZE": "64",
        "AUTOBATCH_WORLD_SIZE": "1",
        "AUTOBATCH_RECOMMENDED_MICRO_BATCH_SIZE": "24",
        "AUTOBATCH_MEASURED_MAX_MICRO_BATCH_SIZE": "",  # a number given: no profile measured it
        "AUTOBATCH_MAX_MICRO_BATCH_SIZE": "24",
        "AUTOBATCH_MICRO_BATCH_SIZES": "16,16,16,16",
        "AUTOBATCH_PLAN_SOURCE": "given",
        "AUTOBATCH_PREDICTED_PEAK_MEMORY_BYTES": "",
        "AUTOBATCH_ACTIVATION_CHECKPOINTING": "none",
    }


def test_output_writes_env_or_json_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = ("plan", "--max-micro-batch-size", "7", "--effective-batch-size", "26")
    code, out, _ = run(capsys, *base, "--output", str(tmp_path / "plan.env"))
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'plan.env'}: micro_batch_size 7")
    written = sourced((tmp_path / "plan.env").read_text())
    assert written["AUTOBATCH_MICRO_BATCH_SIZES"] == "7,7,6,6"  # unequal: 26 = 7+7+6+6
    code, _, _ = run(capsys, *base, "--output", str(tmp_path / "plan.json"))
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["env"] == written and data["plan"]["effective_batch_size"] == 26
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    ("plan_source", "match", "expected"),
    [
        ("cached", "measured", "cached"),  # the JSON's word: a stored profile's real trials
        ("predicted", "measured", "predicted"),  # measured on the card, past its sizes
        ("cached", "predicted", "predicted"),  # measured on another card
        ("estimated", "estimated", "estimated"),
    ],
)
def test_plan_source_is_predicted_when_either_side_says_so(
    plan_source: str, match: str, expected: str
) -> None:
    planned = {**plan(8, effective_batch_size=16).to_dict(), "source": plan_source}
    answer = {
        "profile_id": "p1",
        "selection": {"match": match, "card": "L4", "node_name": "n1", "device_name": "A100"},
    }

    variables = env_variables(planned, answer)

    assert variables["AUTOBATCH_PLAN_SOURCE"] == expected
    assert variables["AUTOBATCH_PROFILE_MATCH"] == match
    assert variables["AUTOBATCH_PROFILE_ID"] == "p1"
    assert variables["AUTOBATCH_PROFILE_NODE"] == "n1"
    assert variables["AUTOBATCH_PROFILE_CARD"] == "A100"
    assert variables["AUTOBATCH_PLAN_CARD"] == "L4"


def test_an_unreachable_service_exits_non_zero_and_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    code, out, err = run(
        capsys,
        "plan",
        "--service",
        url,
        "--model-fingerprint",
        "fp",
        "--card",
        "NVIDIA L4",
        "--effective-batch-size",
        "64",
        "--output",
        str(tmp_path / "plan.env"),
    )

    assert (code, out) == (1, "")
    assert err.startswith(f"autobatch plan: error: could not connect to {url}: ")
    assert not (tmp_path / "plan.env").exists()


def test_service_flags_need_a_model_and_a_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AUTOBATCH_CENTRAL_URL", raising=False)
    code, _, err = run(
        capsys, "plan", "--max-micro-batch-size", "8", "--card", "L4", "--effective-batch-size", "8"
    )
    assert code == 1 and "--card choose among a service's stored profiles" in err
    code, _, err = run(
        capsys, "plan", "--model-fingerprint", "fp", "--card", "L4", "--effective-batch-size", "8"
    )
    assert code == 1 and "give --service URL (or set AUTOBATCH_CENTRAL_URL)" in err
    with pytest.raises(SystemExit):
        main(
            [
                "plan",
                "--model-fingerprint",
                "fp",
                "--condition",
                "amp",
                "--effective-batch-size",
                "8",
            ]
        )
    assert "'amp' is not NAME=VALUE" in capsys.readouterr().err


def test_tune_report_to_publishes_the_new_profile_through_a_failing_first_try(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server = FlakyServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.script = ["503"]  # a replica restarting: the first try fails, the retry lands
    try:
        code, out, err = run(
            capsys,
            *["--store", str(tmp_path / "s.sqlite3"), "tune", "tests.service.models:tiny_mlp"],
            *["--input-shape", "32", "--device", "sim:4MiB", "--effective-batch-size", "64"],
            *["--json", "--report-to", server.url],
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

    assert code == 0, err
    assert len(server.bodies) == 2 and server.bodies[0] == server.bodies[1]
    published = Profile.from_dict(json.loads(server.bodies[1]))
    assert published == Profile.from_dict(json.loads(out)["profile"])


def test_a_card_in_node_label_form_plans_from_the_profile_measured_on_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A central service holds the model measured on a whole H100 and, newer, on an L40S: the
    # card named as GPU feature discovery labels it is the H100, measured (it exited 1 before).
    from tests.service.serving import serving
    from tests.service.test_plan_selection import NEWEST_L40S, WHOLE

    with serving(tmp_path) as server:
        for profile in (WHOLE, NEWEST_L40S):
            assert server.client.post("/v1/profiles", json=profile.to_dict()).status_code == 201
        url = f"http://127.0.0.1:{server.port}"
        code, out, err = run(
            capsys,
            "plan",
            "--service",
            url,
            "--model-fingerprint",
            "fp-gpt2",
            "--card",
            "NVIDIA-H100-80GB-HBM3",
            "--effective-batch-size",
            "128",
            "--env",
        )

    assert (code, err) == (0, "")
    exported = sourced(out)
    assert exported["AUTOBATCH_MICRO_BATCH_SIZE"] == "32"
    assert exported["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert exported["AUTOBATCH_PLAN_SOURCE"] == "cached"
    assert exported["AUTOBATCH_PROFILE_MATCH"] == "measured"
    assert exported["AUTOBATCH_PLAN_CARD"] == "NVIDIA-H100-80GB-HBM3"
    assert exported["AUTOBATCH_PROFILE_CARD"] == "NVIDIA H100 80GB HBM3"


STEP_OF_1_IN_8_PER_NODE = {  # sbatch --ntasks-per-node=8 --gres=gpu:8; srun --ntasks=1 torchrun
    "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_NTASKS_PER_NODE": "8", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1",
    "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NUM_NODES": "1",
}  # fmt: skip
HYDRA_IN_SLURM = {  # mpiexec (MPICH/Intel MPI) whose proxies srun started, one per node
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "16",
    "PMI_RANK": "11",
}  # fmt: skip


def test_the_launcher_command_reads_the_steps_tasks_and_words_refusals_as_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in STEP_OF_1_IN_8_PER_NODE.items():
        monkeypatch.setenv(name, value)
    assert run(capsys, "launcher", "--slurm-task-ranks", "gpus", "--world-size") == (0, "8\n", "")
    for name, value in HYDRA_IN_SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_NTASKS")
    code, out, err = run(capsys, "launcher")
    assert (code, out) == (1, "")
    assert err.startswith(
        "autobatch launcher: error: mpirun (MPICH or Intel MPI) says PMI_SIZE=16 but Slurm job 7's "
        "step says SLURM_STEP_NUM_TASKS=2: "
    )
    assert err.endswith(
        "; use world size 16 (if mpirun started the ranks), or world size 2 (if srun started "
        "them, one rank per task)\ntry 'autobatch launcher --help'\n"  # --world-size: a switch
    )


def _prolog(
    tmp_path: Path, environ: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run deploy/slurm/prolog.sh with ``environ``; ``autobatch plan`` is a stub that records its
    arguments (and fails: no service), ``autobatch launcher`` this checkout's own."""
    import sys

    root = Path(__file__).resolve().parents[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "autobatch"
    stub.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = plan ]; then echo "$@" > {tmp_path}/plan-args\n'
        "echo no service >&2; exit 1; fi\n"
        f'exec {sys.executable} -m autobatch "$@"\n'
    )
    stub.chmod(0o755)
    done = subprocess.run(
        ["sh", str(root / "deploy" / "slurm" / "prolog.sh")],
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "PYTHONPATH": str(root),
            "AUTOBATCH_MODEL_FINGERPRINT": "9c1e5b0f7a3d2e48",
            "AUTOBATCH_EFFECTIVE_BATCH_SIZE": "256",
            "AUTOBATCH_CARD": "NVIDIA H100 80GB HBM3",
            "AUTOBATCH_PLAN_DIR": str(tmp_path),
            **environ,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    args = tmp_path / "plan-args"
    return done, args.read_text() if args.exists() else ""


def test_the_prolog_plans_a_step_smaller_than_its_allocation_for_its_gpus(
    tmp_path: Path,
) -> None:
    done, args = _prolog(tmp_path, STEP_OF_1_IN_8_PER_NODE)
    assert " --world-size 8 " in args  # 8 torchrun ranks in the step's one task, not 1
    assert done.stdout == "export AUTOBATCH_PLAN_ERROR=1\n"  # the stub's "no service"


def test_the_prolog_refuses_two_launchers_that_disagree_by_name(tmp_path: Path) -> None:
    done, args = _prolog(tmp_path, HYDRA_IN_SLURM)
    assert args == ""  # no plan asked for a guessed world size
    assert done.returncode == 0  # the task starts, without a plan
    assert done.stdout == "export AUTOBATCH_PLAN_ERROR=1\n"
    assert "PMI_SIZE=16 but Slurm job 7's step says SLURM_STEP_NUM_TASKS=2" in done.stderr
    assert "world size 16 (if mpirun started the ranks)" in done.stderr
    prolog_fix = "; in a TaskProlog, the job gives it as AUTOBATCH_JOB_WORLD_SIZE=N\n"
    assert done.stderr.endswith(prolog_fix)


def test_the_launcher_commands_count_to_fill_in_is_plain_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert run(capsys, "launcher", "--world-size") == (
        1,
        "",
        "autobatch launcher: error: WORLD_SIZE=2 but OMPI_COMM_WORLD_SIZE=4 (mpirun (Open MPI)): "
        "the environment says two sizes of one group; use an environment without WORLD_SIZE, or "
        "world size N (the number of data-parallel ranks that train)\n"  # --world-size: a switch
        "try 'autobatch launcher --help'\n",
    )


def test_plan_service_names_the_conditions_its_profile_was_measured_under(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fleet's profile was measured under torch 2.11 and driver 550; this machine runs another
    # torch. The text answer names both, and the flag that asks for a profile of this torch.
    from importlib import metadata

    from tests.service.serving import serving
    from tests.service.test_plan_selection import WHOLE

    measured = Profile.from_dict(
        {**WHOLE.to_dict(), "torch_version": "2.11.0", "driver_version": "550.54.15"}
    )
    here = metadata.version("torch")
    with serving(tmp_path) as server:
        assert server.client.post("/v1/profiles", json=measured.to_dict()).status_code == 201
        url = f"http://127.0.0.1:{server.port}"
        fleet = ["plan", "--service", url, "--model-fingerprint", "fp-gpt2"]
        fleet += ["--card", "NVIDIA H100 80GB HBM3", "--effective-batch-size", "128"]
        code, out, err = run(capsys, *fleet)
        asked_code, asked, _ = run(capsys, *fleet, "--condition", f"torch_version={here}")

    assert (code, err) == (0, "")
    lines = out.splitlines()
    under = next(line for line in lines if line.startswith("measured under"))
    # In words, not the service's field names: "torch 2.11.0", never "torch_version 2.11.0".
    assert "torch 2.11.0, driver 550.54.15" in under and "_" not in under.split(None, 2)[2]
    assert (
        f"note: the profile was measured under torch 2.11.0, this machine has torch {here}: "
        f"--condition torch_version={here} asks for a profile measured under it"
    ) in out
    assert "(measured on NVIDIA H100 80GB HBM3" in out and "measured: measured" not in out
    # Asked for this machine's torch: the same profile, now a prediction that says why.
    assert asked_code == 0
    assert "(predicted, measured on NVIDIA H100 80GB HBM3" in asked
    assert f"note: measured under other conditions: torch: recorded 2.11.0, asked {here}" in asked
