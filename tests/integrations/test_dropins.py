"""The framework drop-ins' package: it imports neither torch nor a framework. (How many samples an
epoch's last optimizer step sees: ``tests/planning/test_epochs.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autobatch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_integrations_package_imports_no_torch_and_no_framework() -> None:
    # Each framework's drop-in lives in its own submodule; the package itself only has configs.
    code = (
        "import sys, autobatch.integrations as i; i.hf_training_arguments;"
        "print(sorted(m for m in ('torch', 'lightning', 'transformers', 'accelerate')"
        " if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.split() == ["[]"]


@pytest.mark.parametrize(
    ("caller", "framework"),
    [
        ("AutobatchFinder", "Lightning"),
        ("autotune_trainer", "the Hugging Face Trainer"),
        ("autotune_accelerator", "Accelerate"),
    ],
)
def test_mixed_ranks_is_refused_by_each_drop_in_naming_its_framework(
    caller: str, framework: str
) -> None:
    from autobatch.integrations._dropins import check_options

    check_options({"mixed_ranks": False}, caller=caller)  # the option is known, and off
    with pytest.raises(
        ConfigError,
        match=rf"{caller} cannot run mixed_ranks=True: {framework} gives every rank one "
        r"micro-batch size.*MixedBatchSampler",
    ):
        check_options({"mixed_ranks": True}, caller=caller)
