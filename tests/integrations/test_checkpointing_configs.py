"""The configs autobatch writes carry a plan's activation checkpointing mode: Hugging Face's
``gradient_checkpointing``, DeepSpeed's ``activation_checkpointing`` section, and the mode for a
LightningModule's ``configure_model``; a plan without checkpointing writes what it always did."""

from __future__ import annotations

import dataclasses

import pytest

from autobatch.integrations import deepspeed_config, hf_training_arguments, lightning_config
from autobatch.integrations._configs import DEFAULT_EVERY
from autobatch.planning import Plan, PlanRequest, plan_request
from autobatch.probing._checkpointing import DEFAULT_EVERY as APPLIED_EVERY


def _plan(mode: str) -> Plan:
    plan = plan_request(24, PlanRequest(effective_batch_size=64, world_size=2))
    return dataclasses.replace(plan, activation_checkpointing=mode)  # type: ignore[arg-type]


def test_full_checkpointing_sets_each_frameworks_switch() -> None:
    plan = _plan("full")
    assert hf_training_arguments(plan) == {
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "activation_checkpointing": True,
        "activation_checkpointing_kwargs": {"every_n_layers": 1, "use_reentrant": False},
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


def test_selective_is_every_second_layer_as_the_library_applies_it() -> None:
    transformers = pytest.importorskip("transformers")
    arguments = hf_training_arguments(_plan("selective"))
    every = arguments["activation_checkpointing_kwargs"]["every_n_layers"]
    assert every == DEFAULT_EVERY == APPLIED_EVERY == 2
    assert lightning_config(_plan("selective"))["model"] == {
        "activation_checkpointing": "selective"
    }
    # The Trainer takes them as they are, and transformers checkpoints the same layers.
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], **arguments)
    assert args.activation_checkpointing is True
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.activation_checkpointing_enable(every_n_layers=2)
    flags = [bool(getattr(b, "gradient_checkpointing", False)) for b in model.transformer.h]
    assert flags == [True, False, True, False]
