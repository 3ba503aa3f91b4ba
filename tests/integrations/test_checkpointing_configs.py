"""The configs autobatch writes carry a plan's activation checkpointing mode: Hugging Face's
``gradient_checkpointing``, DeepSpeed's ``activation_checkpointing`` section, and the mode for a
LightningModule's ``configure_model``; a plan without checkpointing writes what it always did."""

from __future__ import annotations

import dataclasses

import pytest

from autobatch.errors import ConfigError
from autobatch.integrations import deepspeed_config, hf_training_arguments, lightning_config
from autobatch.planning import Plan, PlanRequest, plan_request


def _plan(mode: str) -> Plan:
    plan = plan_request(24, PlanRequest(effective_batch_size=64, world_size=2))
    return dataclasses.replace(plan, activation_checkpointing=mode)  # type: ignore[arg-type]


def test_full_checkpointing_sets_each_frameworks_switch() -> None:
    plan = _plan("full")
    assert hf_training_arguments(plan) == {
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }
    section = deepspeed_config(plan)["activation_checkpointing"]
    assert section["partition_activations"] is False
    assert section["number_checkpoints"] is None
    assert lightning_config(plan)["model"] == {"activation_checkpointing": "full"}
    assert Plan.from_dict(plan.to_dict()).activation_checkpointing == "full"


def test_no_checkpointing_writes_the_batch_keys_alone() -> None:
    plan = _plan("none")
    assert hf_training_arguments(plan) == {
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2,
    }
    assert "activation_checkpointing" not in deepspeed_config(plan)
    assert set(lightning_config(plan)) == {"trainer", "dataloader"}


def test_selective_is_refused_by_the_hf_switch_with_the_fix() -> None:
    plan = _plan("selective")
    with pytest.raises(ConfigError, match=r"apply_activation_checkpointing\(model, 'selective'\)"):
        hf_training_arguments(plan)
    assert lightning_config(plan)["model"] == {"activation_checkpointing": "selective"}
    assert "activation_checkpointing" in deepspeed_config(plan)
