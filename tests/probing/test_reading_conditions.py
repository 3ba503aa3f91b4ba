"""The reader of conditions reads the live process: the allocator settings torch applied (not the
variables as set), bytes by dtype, checkpointing, the optimizer and its state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from autobatch.errors import Remedy
from autobatch.probing._live_conditions import (
    activation_checkpointing,
    precision_remedies,
    process_conditions,
    read_conditions,
    with_optimizer_state,
)

ROOT = Path(__file__).resolve().parents[2]


def test_allocator_settings_are_read_back_from_torch(set_allocator: Callable[[str], None]) -> None:
    set_allocator("max_split_size_mb:128, expandable_segments:True")
    conditions = process_conditions(device_type="cuda")
    assert conditions.allocator_source == "torch"
    assert conditions.allocator_settings == "expandable_segments:True,max_split_size_mb:128"


def test_a_variable_set_after_torch_read_its_settings_is_not_in_effect(
    monkeypatch: pytest.MonkeyPatch, set_allocator: Callable[[str], None]
) -> None:
    set_allocator("")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    conditions = process_conditions(device_type="cuda")
    assert conditions.allocator_settings == ""
    assert conditions.allocator_environment == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert conditions.ignored_allocator_variables == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:True"
    }


def _settings_at_start(environ: dict[str, str]) -> dict[str, Any]:
    """In a new process started with ``environ``: the allocator settings in effect and the
    variables not in effect, once torch has read its settings, and after
    ``PYTORCH_ALLOC_CONF`` is changed later."""
    code = (
        "import json, os, torch; from autobatch.probing._live_conditions import process_conditions;"
        "first = process_conditions(device_type='cuda');"
        "os.environ['PYTORCH_ALLOC_CONF'] = 'max_split_size_mb:64';"
        "later = process_conditions(device_type='cuda');"
        "print(json.dumps([first.allocator_settings, first.ignored_allocator_variables,"
        " later.allocator_settings, later.ignored_allocator_variables]))"
    )
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    names = ("in effect", "ignored", "in effect later", "ignored later")
    return dict(zip(names, json.loads(done.stdout), strict=True))


@pytest.mark.slow
def test_either_variable_name_set_at_start_is_in_effect_and_one_set_later_is_not() -> None:
    # Either name set when the process starts is what torch applies; the profile records that,
    # so the two names with one value are one condition, and a change after torch read its
    # settings is named as not in effect.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        found = _settings_at_start({name: "expandable_segments:True"})
        assert found["in effect"] == found["in effect later"] == "expandable_segments:True"
        assert found["ignored"] == {}
        assert found["ignored later"] == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    # Both set: torch applies one (this torch: PYTORCH_CUDA_ALLOC_CONF), and the other is named.
    both = _settings_at_start(
        {
            "PYTORCH_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128",
        }
    )
    assert len(both["ignored"]) == 1
    assert both["in effect"] in ("expandable_segments:True", "max_split_size_mb:128")


def test_cudnn_flags_are_read_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert process_conditions().cudnn["benchmark"] == "True"
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert process_conditions().cudnn["benchmark"] == "False"


class Mixed(torch.nn.Module):
    """bf16 weights with an fp32 head, part of it frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 2)
        self.head.bias.requires_grad_(False)


def test_bytes_by_dtype_and_the_trainable_fraction() -> None:
    conditions = read_conditions(Mixed(), None, device_type="cpu", amp_dtype=torch.bfloat16)
    assert conditions.parameter_bytes == {"bfloat16": 72 * 2, "float32": 18 * 4}
    assert conditions.gradient_bytes == {"bfloat16": 72 * 2, "float32": 16 * 4}
    assert (conditions.num_parameters, conditions.num_trainable_parameters) == (90, 88)
    assert conditions.amp_dtype == "bfloat16"
    assert conditions.optimizer == "torch.optim.adamw.AdamW"  # the probe's own
    assert conditions.optimizer_state_dtype == ""  # no step yet


class ByteStateSGD(torch.optim.SGD):
    """An optimizer keeping a one-byte state per element, as 8-bit optimizers do."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state["quantized"] = torch.zeros_like(param, dtype=torch.uint8)
                    state["absmax"] = torch.zeros(1)
        return super().step(closure)


def test_the_optimizer_and_its_state_dtype_after_a_step() -> None:
    model = torch.nn.Linear(16, 16)
    optimizer = ByteStateSGD(model.parameters(), lr=0.1)
    before = read_conditions(model, optimizer, device_type="cpu", amp_dtype=None)
    assert before.optimizer.endswith("test_reading_conditions.ByteStateSGD")
    assert before.optimizer_state_bytes == {}
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    after = with_optimizer_state(before, optimizer)
    assert after.optimizer_state_bytes == {"float32": 8, "uint8": 272}
    assert after.optimizer_state_dtype == "uint8"


def test_activation_checkpointing_is_detected_where_modules_say_so() -> None:
    from torch.distributed._composable.checkpoint_activation import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert activation_checkpointing(plain) == "none detected"
    wrapped = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)), torch.nn.ReLU())
    assert activation_checkpointing(wrapped) == "checkpoint_wrapper around 1 modules"
    composable = torch.nn.Sequential(torch.nn.Linear(4, 4))
    checkpoint(composable[0])
    assert "composable.checkpoint on 1 modules" in activation_checkpointing(composable)


def test_hugging_face_checkpointing_with_its_settings() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    assert activation_checkpointing(model) == "none detected"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert activation_checkpointing(model) == (
        "Hugging Face gradient_checkpointing on 3 modules "
        "(torch.utils.checkpoint.checkpoint, use_reentrant=True)"
    )


@pytest.mark.parametrize(
    ("amp_dtype", "model", "expected"),
    [
        (None, torch.nn.Linear(4, 4), ["amp_dtype=bfloat16"]),
        (torch.bfloat16, torch.nn.Linear(4, 4), ["parameters stored in bfloat16"]),
        (torch.bfloat16, torch.nn.Linear(4, 4).to(torch.bfloat16), []),
    ],
    ids=["no AMP", "AMP over fp32 parameters", "AMP over bf16 parameters"],
)
def test_precision_remedies_never_suggest_what_is_in_effect(
    amp_dtype: torch.dtype | None, model: torch.nn.Module, expected: list[str]
) -> None:
    conditions = read_conditions(model, None, device_type="cuda", amp_dtype=amp_dtype)
    remedies = precision_remedies(conditions)
    assert [_said(r) for r in remedies] == expected
    assert all(r.parameter != "amp_dtype" for r in remedies) or amp_dtype is None


def _said(remedy: Remedy) -> str:
    if remedy.parameter:
        return f"{remedy.parameter}={remedy.values[0]}"
    return remedy.purpose.split(":")[0]


@pytest.mark.parametrize("rank", [0, 3])
def test_a_sharded_parameter_counts_its_padded_shard_the_same_on_every_rank(rank: int) -> None:
    # FSDP2 shards a 10-row parameter over 4 ranks as 3, 3, 3, 1 rows and allocates each rank
    # 3 rows: the bytes are the padded shard's, so every rank has the same cache key.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        rows = 3 if rank < 3 else 1
        shard = DTensor.from_local(
            torch.zeros(rows, 3), mesh, [Shard(0)], shape=torch.Size([10, 3]), stride=(3, 1)
        )
        model = torch.nn.Module()
        model.weight = torch.nn.Parameter(shard)
        conditions = read_conditions(model, None, device_type="cpu", amp_dtype=None)
    finally:
        dist.destroy_process_group()
    assert conditions.parameter_bytes == {"float32": 3 * 3 * 4}
    assert conditions.num_parameters == 9
