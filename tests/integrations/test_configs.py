"""Tests for autobatch.integrations, checked against each framework's own batch rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from autobatch.errors import ConfigError
from autobatch.integrations._configs import (
    deepspeed_config,
    format_config,
    hf_training_arguments,
    lightning_config,
)
from autobatch.planning import Plan
from tests.planning.test_mixed import mixed
from tests.planning.test_planner import plan

# (max micro-batch, effective batch, world size) -> every plan here has equal micro-batches.
CASES = [(24, 64, 1), (24, 96, 4), (24, 192, 8), (8, 8, 8), (10**6, 10**9, 8), (24, 54, 3)]


def make_plan(limit: int, effective: int, world_size: int) -> Plan:
    return plan(limit, effective_batch_size=effective, world_size=world_size, uneven="never")


def deepspeed_batch_settings(config: dict[str, int], world_size: int) -> dict[str, int]:
    """DeepSpeed's own reading of the batch keys, replicated because DeepSpeed is not installed
    here: the missing one is derived, then all three are checked. DeepSpeed reads a config
    before its process group exists too (ZeRO-3's ``zero.Init`` inside ``from_pretrained``
    under ``HfDeepSpeedConfig``), with a world size of 1.

    Source: DeepSpeed ``deepspeed/runtime/config.py``, ``DeepSpeedConfig.
    _set_batch_related_parameters`` and ``_batch_assertion``.
    """
    train_batch = config.get("train_batch_size")
    micro_batch = config.get("train_micro_batch_size_per_gpu")
    grad_acc = config.get("gradient_accumulation_steps")
    if train_batch is not None and micro_batch is not None and grad_acc is not None:
        pass
    elif train_batch is not None and micro_batch is not None:
        grad_acc = train_batch // micro_batch // world_size
    elif train_batch is not None and grad_acc is not None:
        micro_batch = train_batch // world_size // grad_acc
    elif micro_batch is not None and grad_acc is not None:
        train_batch = micro_batch * grad_acc * world_size
    else:
        raise AssertionError("replica covers the cases autobatch emits")
    assert train_batch > 0, f"Train batch size: {train_batch} has to be greater than 0"
    assert micro_batch > 0, f"Micro batch size per gpu: {micro_batch} has to be greater than 0"
    assert grad_acc > 0, f"Gradient accumulation steps: {grad_acc} has to be greater than 0"
    assert train_batch == micro_batch * grad_acc * world_size, (
        "Check batch related parameters. train_batch_size is not equal to "
        f"micro_batch_per_gpu * gradient_acc_step * world_size "
        f"{train_batch} != {micro_batch} * {grad_acc} * {world_size}"
    )
    return {
        "train_batch_size": train_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_acc,
    }


@pytest.mark.parametrize(("limit", "effective", "world_size"), CASES)
def test_deepspeed_config_passes_deepspeeds_batch_rule_before_and_after_its_process_group(
    limit: int, effective: int, world_size: int
) -> None:
    result = make_plan(limit, effective, world_size)
    config = deepspeed_config(result)

    assert config == {
        "train_micro_batch_size_per_gpu": result.micro_batch_size,
        "gradient_accumulation_steps": result.gradient_accumulation_steps,
    }
    deepspeed_batch_settings(config, world_size=1)  # before the group: no AssertionError
    launched = deepspeed_batch_settings(config, world_size)
    assert launched["train_batch_size"] == effective  # the plan's effective batch, exactly


def test_a_pinned_train_batch_size_fails_deepspeeds_check_before_its_process_group() -> None:
    # A config with train_batch_size pinned, read by DeepSpeed with world size 1 (before
    # init_process_group) for a plan of 1 x 8 on 2 ranks: the job died there.
    result = make_plan(1, 16, 2)
    pinned = {"train_batch_size": 16, **deepspeed_config(result)}
    with pytest.raises(AssertionError, match=re.escape("16 != 1 * 8 * 1")):
        deepspeed_batch_settings(pinned, world_size=1)


@pytest.mark.parametrize(("limit", "effective", "world_size"), CASES)
def test_hf_training_arguments_are_accepted_by_transformers(
    limit: int, effective: int, world_size: int, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    result = make_plan(limit, effective, world_size)
    kwargs = hf_training_arguments(result)

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)

    assert kwargs == {
        "per_device_train_batch_size": result.micro_batch_size,
        "gradient_accumulation_steps": result.gradient_accumulation_steps,
    }
    # Not launched distributed here: one process, no GPU, so transformers sees world size 1 and
    # its per-step batch is the per-device one; the launcher supplies the plan's world size.
    assert args.world_size == 1
    assert args.train_batch_size == result.micro_batch_size
    assert args.train_batch_size * args.gradient_accumulation_steps * world_size == effective


@pytest.mark.parametrize(("limit", "effective", "world_size"), CASES[:3])
def test_lightning_config_is_accepted_by_lightning(
    limit: int, effective: int, world_size: int, tmp_path: Path
) -> None:
    lightning = pytest.importorskip("lightning")
    torch_data = pytest.importorskip("torch.utils.data")
    result = make_plan(limit, effective, world_size)
    config = lightning_config(result)

    trainer = lightning.Trainer(
        **config["trainer"],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    loader = torch_data.DataLoader(list(range(effective)), **config["dataloader"])

    assert config == {
        "trainer": {"accumulate_grad_batches": result.gradient_accumulation_steps},
        "dataloader": {"batch_size": result.micro_batch_size},
    }
    assert trainer.accumulate_grad_batches == result.gradient_accumulation_steps
    assert len(next(iter(loader))) == result.micro_batch_size
    assert loader.batch_size * trainer.accumulate_grad_batches * world_size == effective


@pytest.mark.parametrize(
    ("convert", "framework"),
    [
        (deepspeed_config, "DeepSpeed"),
        (hf_training_arguments, "Hugging Face TrainingArguments"),
        (lightning_config, "Lightning"),
    ],
)
def test_unequal_micro_batches_cannot_be_expressed(convert: object, framework: str) -> None:
    result = plan(24, effective_batch_size=97)  # (20, 20, 19, 19, 19)
    assert callable(convert)
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{framework} takes one micro-batch size") + r".*uneven='never'",
    ):
        convert(result)


@pytest.mark.parametrize(
    ("convert", "framework"),
    [
        (deepspeed_config, "DeepSpeed"),
        (hf_training_arguments, "Hugging Face TrainingArguments"),
        (lightning_config, "Lightning"),
    ],
)
def test_a_mixed_plan_is_refused_by_name(convert: object, framework: str) -> None:
    # DeepSpeed's train_batch_size = micro x k x world_size would be 2 x 48 x 1 = 96 here on
    # rank 0, 2 x 20 x 2 = 80 on rank 1, and its equal-weight gradient average wrong on both.
    result = mixed([48, 20], effective_batch_size=96)[1]
    assert callable(convert)
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{framework} takes one micro-batch size for every rank")
        + r".*a mixed plan \(a micro-batch per rank: \[34, 14\]\).*MixedBatchSampler",
    ):
        convert(result)
    with pytest.raises(ConfigError, match="this is a mixed plan"):
        format_config(result, "deepspeed")
    assert json.loads(format_config(result, "json"))["rank_micro_batch_sizes"] == [34, 14]


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (
            "deepspeed",
            {
                "train_micro_batch_size_per_gpu": 16,
                "gradient_accumulation_steps": 4,
            },
        ),
        ("hf", {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}),
        (
            "lightning",
            {"trainer": {"accumulate_grad_batches": 4}, "dataloader": {"batch_size": 16}},
        ),
    ],
)
def test_format_config_framework_json(fmt: str, expected: dict[str, object]) -> None:
    result = plan(24, effective_batch_size=128, world_size=2)  # 16 x 4 per rank

    text = format_config(result, fmt)  # type: ignore[arg-type]

    assert json.loads(text) == expected
    assert not text.endswith("\n")


def test_format_config_json_is_the_whole_plan() -> None:
    result = plan(24, effective_batch_size=97)

    text = format_config(result, "json")

    assert Plan.from_dict(json.loads(text)) == result
    assert json.loads(text)["micro_batch_sizes"] == [20, 20, 19, 19, 19]


def test_format_config_unknown_format() -> None:
    with pytest.raises(ConfigError, match=re.escape("config format 'yaml' must be one of")):
        format_config(plan(24, effective_batch_size=64), "yaml")  # type: ignore[arg-type]
