"""The evaluation micro-batch: its own probe (a forward under inference_mode, model in eval
mode), reported as ``eval_micro_batch_size``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError
from autobatch.integrations._configs import hf_training_arguments
from autobatch.probing._prober import probe
from autobatch.profile import Profile
from autobatch.tuning import tune
from service.web.schemas import ProfileCreate
from tests.planning.test_planner import plan
from tests.probing.test_probe import UNIT, Moments, Toy, assert_same_state, state_of
from tests.probing.test_probe_steps import CAPACITY_BYTES


class Recording(Toy):
    """Toy with a dropout and a BatchNorm, recording how each forward ran."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.norm = torch.nn.BatchNorm1d(4)
        self.calls: list[tuple[bool, bool, bool]] = []  # (training, inference mode, grad mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(
            (self.training, torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        )
        return (self.drop(x).mean() + self.norm(x[:, :4]).mean()) * self.w.sum()


def test_eval_without_optimizer_counts_the_weights_only() -> None:
    # 100 units: weights 10 and a unit per sample (no gradients, no optimizer state): 90;
    # the training step (gradients 10, moments 20) fits 60.
    model = Toy()
    profile = probe(
        model,
        torch.randn(1, UNIT),
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        eval=True,
    )
    assert profile.mode == "eval"
    assert profile.max_micro_batch_size == 90
    assert not any(t.warm_up for t in profile.trials)
    assert profile.trials[-1].repeat and profile.trials[-1].micro_batch_size == 90
    assert any("estimate not used" in note for note in profile.notes)
    # the new fields travel: the store's dict and the service's schema
    assert Profile.from_dict(profile.to_dict()) == profile
    body = ProfileCreate.model_validate(profile.to_dict(), strict=False)
    assert body.mode == "eval" and body.trials[-1].repeat


def test_eval_during_training_counts_the_optimizer_state_and_leaves_no_trace() -> None:
    model = Recording()
    model.norm.eval()  # mixed flags, restored as they were
    optimizer = Moments(model.parameters())
    sample = torch.randn(2, UNIT)
    before = state_of(model, optimizer)
    profile = probe(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        eval=True,
    )
    # weights 10 + moments 20 (created by one training step) + a unit per sample
    assert profile.max_micro_batch_size == 70
    # the training step that created the moments (at 1, which BatchNorm refuses, then at 2),
    # then evaluation only
    assert model.calls[:2] == [(True, False, True)] * 2
    assert model.calls[2:] and set(model.calls[2:]) == {(False, True, False)}
    assert [t.warm_up for t in profile.trials] == [True] + [False] * (len(profile.trials) - 1)
    assert not any(t.skipped_optimizer_step for t in profile.trials)
    assert model.training and not model.norm.training
    assert_same_state(before, state_of(model, optimizer))
    assert not optimizer._optimizer_step_post_hooks


def test_eval_profile_is_not_a_training_profile() -> None:
    model = Toy()
    kwargs = {"loss_fn": lambda out: out, "device": SimulatedDevice(capacity_bytes=CAPACITY_BYTES)}
    evaluation = probe(model, torch.randn(1, UNIT), eval=True, **kwargs)
    training = probe(model, torch.randn(1, UNIT), optimizer=Moments(model.parameters()), **kwargs)
    assert training.mode == "train" and training.max_micro_batch_size == 60
    assert evaluation.cache_key() != training.cache_key()
    assert '"mode"' not in training.cache_key()  # training keys stored earlier still answer
    with pytest.raises(ConfigError, match="measured evaluation.*plan from a training profile"):
        plan(evaluation, effective_batch_size=64)


def test_eval_with_a_step_that_updates_by_itself_is_refused() -> None:
    model = Toy()
    optimizer = Moments(model.parameters())
    with pytest.raises(ConfigError, match="eval=True.*step_includes_update=False"):
        probe(
            model,
            torch.randn(1, UNIT),
            optimizer=optimizer,
            train_step=lambda m, batch: m(batch),
            step_includes_update=True,
            device="sim:1GiB",
            eval=True,
        )


def test_tune_with_eval_reports_the_eval_micro_batch(tmp_path: Path) -> None:
    model = Toy()
    kwargs = {
        "loss_fn": lambda out: out,
        "optimizer": Moments(model.parameters()),
        "device": SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        "effective_batch_size": 120,
        "store": tmp_path / "profiles.sqlite3",
        "eval": True,
    }
    tuned = tune(model, torch.randn(1, UNIT), **kwargs)
    assert tuned.eval_profile is not None and tuned.eval_profile.mode == "eval"
    assert tuned.plan.micro_batch_size * tuned.plan.gradient_accumulation_steps == 120
    assert tuned.plan.eval_micro_batch_size == tuned.eval_profile.recommended_micro_batch_size
    assert tuned.plan.eval_micro_batch_size > tuned.plan.micro_batch_size
    assert hf_training_arguments(tuned.plan)["per_device_eval_batch_size"] == (
        tuned.plan.eval_micro_batch_size
    )
    again = tune(model, torch.randn(1, UNIT), **kwargs)  # both answered from the store
    assert again.plan.source == "cached"
    assert again.eval_profile == tuned.eval_profile
    assert dataclasses.replace(again.plan, source="measured") == tuned.plan


def test_cli_tune_eval_prints_and_configures_the_eval_micro_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from autobatch.cli import main

    argv = ["tune", "tests.service.models:tiny_mlp", "--input-shape", "32", "--no-store"]
    argv += ["--device", "sim:4MiB", "--effective-batch-size", "64", "--eval"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    size = data["plan"]["eval_micro_batch_size"]
    assert size == data["eval_profile"]["recommended_micro_batch_size"] >= 1
    assert data["eval_profile"]["mode"] == "eval" and data["profile"]["mode"] == "train"
    assert main([*argv, "--format", "hf"]) == 0
    assert json.loads(capsys.readouterr().out)["per_device_eval_batch_size"] == size
    assert main(argv) == 0
    assert f"eval_micro_batch_size        {size}\n" in capsys.readouterr().out


def test_a_frozen_model_is_probed_for_eval_by_its_forward_alone() -> None:
    # No trainable parameter and no optimizer: eval needs no optimizer state, so nothing refuses.
    model = torch.nn.Linear(8, 4)
    model.requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    profile = probe(model, torch.randn(2, 8), device="sim:200KiB", eval=True)
    assert profile.mode == "eval"
    assert profile.max_micro_batch_size > 0
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
        assert not param.requires_grad
        assert param.grad is None
