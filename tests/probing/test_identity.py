"""The step identity (the profile store's cache key) is the same for the same step in any
process, and differs whenever a setting that changes the step's memory does.

Run as a script (``python test_metadata.py``) it prints the keys of :func:`keys` as JSON: the
cross-process test compares two such runs under different hash seeds."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autobatch.integrations._dropins import code_identity
from autobatch.probing._batch import BatchSource
from autobatch.probing._identity import model_fingerprint, module_settings, step_identity
from autobatch.probing._live_conditions import read_conditions
from autobatch.tuning import autotune_profile

SAMPLE = BatchSource.from_sample((torch.randn(2, 8), torch.randint(0, 3, (2,))))
DEVICE = {"device_name": "sim", "total_memory_bytes": 2**30}


class ScaledStep:
    """A ``train_step`` object with a setting, and a non-plain attribute (a module)."""

    def __init__(self, loss_scale: float) -> None:
        self.loss_scale = loss_scale
        self.head = torch.nn.Linear(3, 3)

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels) * self.loss_scale


class OtherStep(ScaledStep):
    """The same settings, other code."""

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs) * 2, labels) * self.loss_scale


@dataclasses.dataclass(frozen=True, slots=True)
class SlottedStep:
    label_smoothing: float

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels, label_smoothing=self.label_smoothing)


def loss_with_comprehension(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Its comprehension is a nested code object (Python 3.11): its repr names an address."""
    return torch.stack([F.cross_entropy(o, y) for o in (out,)]).sum()


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))


def key(model: torch.nn.Module | None = None, source: BatchSource = SAMPLE, **step: Any) -> str:
    """The key a request looks up: the step's identity, the device and the live conditions."""
    model = model if model is not None else small_model()
    conditions = read_conditions(model, None, device_type="sim", amp_dtype=None)
    return step_identity(model, source, None, **step).cache_key(**DEVICE, conditions=conditions)


def test_two_instances_of_a_step_class_with_equal_settings_share_a_key() -> None:
    first, second = ScaledStep(2.0), ScaledStep(2.0)
    assert repr(first) != repr(second)  # an address, which the key leaves out
    assert key(train_step=first) == key(train_step=second)
    assert key(train_step=SlottedStep(0.1)) == key(train_step=SlottedStep(0.1))


def test_a_different_setting_or_step_code_changes_the_key() -> None:
    assert key(train_step=ScaledStep(2.0)) != key(train_step=ScaledStep(4.0))
    assert key(train_step=ScaledStep(2.0)) != key(train_step=OtherStep(2.0))
    assert key(train_step=SlottedStep(0.1)) != key(train_step=SlottedStep(0.2))
    loss = torch.nn.CrossEntropyLoss
    assert key(loss_fn=loss()) == key(loss_fn=loss())
    assert key(loss_fn=loss()) != key(loss_fn=loss(label_smoothing=0.1))


def test_a_bound_method_keys_by_its_object_settings() -> None:
    assert key(train_step=ScaledStep(2.0).__call__) == key(train_step=ScaledStep(2.0).__call__)
    assert key(train_step=ScaledStep(2.0).__call__) != key(train_step=ScaledStep(3.0).__call__)


def test_functions_key_by_their_names_and_constants() -> None:
    assert key(loss_fn=lambda out, y: F.cross_entropy(out, y)) == key(
        loss_fn=lambda out, y: F.cross_entropy(out, y)
    )
    assert key(loss_fn=lambda out, y: F.cross_entropy(out, y)) != key(
        loss_fn=lambda out, y: F.nll_loss(out, y)  # same bytecode, another name
    )
    assert key(loss_fn=lambda out, y: F.mse_loss(out, y) * 2) != key(
        loss_fn=lambda out, y: F.mse_loss(out, y) * 3
    )


def test_module_settings_are_its_plain_public_attributes() -> None:
    assert module_settings(torch.nn.Dropout(0.1)) == "inplace=False,p=0.1"
    linear = torch.nn.Linear(4, 2)
    before = module_settings(linear)
    linear.eval()  # the probe restores train/eval itself
    linear.register_forward_hook(lambda *args: None)
    assert module_settings(linear) == before == "in_features=4,out_features=2"


def test_a_module_setting_changes_the_model_fingerprint_and_weights_do_not() -> None:
    assert model_fingerprint(small_model()) == model_fingerprint(small_model())
    changed = small_model()
    changed[1].p = 0.5
    assert model_fingerprint(changed) != model_fingerprint(small_model())
    changed[1].p = 0.1
    assert model_fingerprint(changed) == model_fingerprint(small_model())


class CountingStep:
    """A step with a plain call counter: state its steps change, and part of its key."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)


def test_a_probe_stores_its_profile_under_the_key_it_was_looked_up_by(tmp_path: Path) -> None:
    sample = (torch.randn(2, 8), torch.randint(0, 3, (2,)))
    options: dict[str, Any] = {
        "device": "sim:1MiB",
        "use_estimate": False,
        "max_micro_batch_size": 16,
        "store": tmp_path / "p.db",
    }
    step = CountingStep()
    first = autotune_profile(small_model(), sample, train_step=step, **options)
    assert not first.cached and step.calls > 1
    second = autotune_profile(small_model(), sample, train_step=CountingStep(), **options)
    assert second.cached and second.profile_id == first.profile_id


def gpt2(checkpointing: bool, **checkpoint_kwargs: Any) -> torch.nn.Module:
    """A tiny random GPT-2, with Hugging Face activation checkpointing on or off."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        with warnings.catch_warnings():  # deprecated in transformers 5, still what users call
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=checkpoint_kwargs or None
            )
    return model


GPT2_SAMPLE = BatchSource.from_sample({"input_ids": torch.randint(0, 64, (2, 16))})


def test_gradient_checkpointing_changes_the_key_and_each_key_is_stable() -> None:
    # A condition of the profile (so a store miss can say that it changed), not the model's
    # fingerprint.
    plain, checkpointed = gpt2(False), gpt2(True)
    assert model_fingerprint(plain) == model_fingerprint(checkpointed)
    assert key(gpt2(False), GPT2_SAMPLE) == key(plain, GPT2_SAMPLE)
    assert key(gpt2(True), GPT2_SAMPLE) == key(checkpointed, GPT2_SAMPLE)
    assert key(plain, GPT2_SAMPLE) != key(checkpointed, GPT2_SAMPLE)
    reentrant = gpt2(True, use_reentrant=True)  # the checkpoint's own settings count too
    assert key(reentrant, GPT2_SAMPLE) != key(checkpointed, GPT2_SAMPLE)


def test_the_attention_kernel_set_on_the_config_changes_the_key() -> None:
    model = gpt2(False)
    sdpa = key(model, GPT2_SAMPLE)
    model.set_attn_implementation("eager")  # changes only model.config, not module attributes
    assert key(model, GPT2_SAMPLE) != sdpa
    model.set_attn_implementation("sdpa")
    assert key(model, GPT2_SAMPLE) == sdpa


def keys() -> dict[str, str]:
    """The keys compared across processes."""
    return {
        "step object": key(train_step=ScaledStep(2.0)),
        "slotted step": key(train_step=SlottedStep(0.1)),
        "nested lambda": key(loss_fn=lambda out, y: (lambda o: F.cross_entropy(o, y))(out)),
        "set constant": key(
            loss_fn=lambda out, y: (
                out.sum()
                if str(y.dtype) in {"torch.float32", "torch.float16"}
                else F.cross_entropy(out, y)
            )
        ),
        "comprehension": key(loss_fn=loss_with_comprehension),
        "drop-in step code": code_identity(loss_with_comprehension),
        "gpt2": key(gpt2(False), GPT2_SAMPLE),
        "gpt2 checkpointed": key(gpt2(True), GPT2_SAMPLE),
    }


@pytest.mark.slow
def test_keys_are_the_same_in_two_processes_with_different_hash_seeds() -> None:
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[2]
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        done = subprocess.run(
            [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1]
    assert len(set(runs[0].values())) == len(runs[0])  # and they differ from one another


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    print(json.dumps(keys()))
