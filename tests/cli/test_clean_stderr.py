"""A torch command of a plain install prints nothing on stderr it did not cause: numpy is a
dependency (without it every torch import warns "Failed to initialize NumPy")."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_numpy_is_a_dependency_of_the_plain_install() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in project["dependencies"]
    ]
    assert "numpy" in names and "torch" in names


def test_a_torch_command_leaves_stderr_clean(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    model = ["tests.service.models:tiny_mlp", "--input-shape", "32"]
    argv = [sys.executable, "-m", "autobatch", "estimate", *model]
    done = subprocess.run(
        [*argv, "--capacity", "1GiB"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "predicted maximum" in done.stdout
