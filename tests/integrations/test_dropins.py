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
    for mode in ("none", "selective", "full", "auto"):  # each drop-in switches it on itself
        check_options({"activation_checkpointing": mode}, caller=caller)


def test_the_drop_ins_refuse_a_step_deepspeed_runs_by_name() -> None:
    # Under DeepSpeed the engine's config sets the micro-batch, not the loader: a plan applied to
    # the loader would not be the batch that trains, so both drop-ins refuse it, naming the keys.
    from types import SimpleNamespace

    import torch

    from autobatch.integrations.accelerate import autotune_accelerator
    from autobatch.integrations.lightning import _tune

    accelerator = SimpleNamespace(
        num_processes=1, split_batches=False, state=SimpleNamespace(deepspeed_plugin=object())
    )
    with pytest.raises(ConfigError, match=r"under DeepSpeed \(Accelerator\(deepspeed_plugin"):
        autotune_accelerator(accelerator, torch.nn.Linear(2, 2), [], effective_batch_size=8)

    class DeepSpeedStrategy:  # Lightning's class, by name (its import needs deepspeed)
        pass

    class TunedStrategy(DeepSpeedStrategy):
        pass

    trainer = SimpleNamespace(strategy=TunedStrategy(), optimizers=[], world_size=1)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        _tune(
            trainer,
            torch.nn.Linear(2, 2),
            effective_batch_size=8,
            device=None,
            batch_arg_name="batch_size",
            options={},
        )
