"""Activation checkpointing applied to a model's repeated blocks and undone
(:mod:`autobatch.probing._checkpointing`): the blocks found, the gradient unchanged (float64,
1e-12), the saved activations smaller, and the model the same objects with the same state after
the undo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autobatch.errors import ConfigError
from autobatch.probing import (
    activation_checkpointing_applied,
    apply_activation_checkpointing,
    checkpointable_blocks,
    read_conditions,
)
from autobatch.probing._checkpointing import checkpointed_blocks

transformers = pytest.importorskip("transformers")


def tiny_gpt2(num_layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=num_layers,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config).double()


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).double()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _gradients(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_gradient_with_a_mode_equals_the_plain_one(build: Any, mode: Any) -> None:
    model = build()
    num_blocks = len(checkpointable_blocks(model))
    batch = _batch()
    plain = _gradients(model, batch)
    with activation_checkpointing_applied(model, mode):
        # every 2nd block of 4 (GPT-2) or 3 (Llama): blocks 0 and 2
        assert checkpointed_blocks(model) == (2 if mode == "selective" else num_blocks)
        checkpointed = _gradients(model, batch)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-12, msg=name)


def test_the_blocks_are_the_longest_list_of_one_class() -> None:
    model = tiny_gpt2()
    assert checkpointable_blocks(model) == list(model.transformer.h)
    assert len(checkpointable_blocks(tiny_llama())) == 3
    named = checkpointable_blocks(model, block_class="GPT2MLP")
    assert [id(m) for m in named] == [id(b.mlp) for b in model.transformer.h]


def test_selective_checkpoints_every_nth_block() -> None:
    model = tiny_gpt2(num_layers=5)
    with activation_checkpointing_applied(model, "selective", every=2):
        marked = ["forward" in b.__dict__ for b in model.transformer.h]
    assert marked == [True, False, True, False, True]
    with activation_checkpointing_applied(model, "selective", every=3):
        marked = ["forward" in b.__dict__ for b in model.transformer.h]
    assert marked == [True, False, False, True, False]


def test_the_undo_leaves_the_same_modules_with_the_same_state() -> None:
    model = tiny_gpt2()
    modules = dict(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = list(model.state_dict())
    undo = apply_activation_checkpointing(model, "full")
    assert list(model.state_dict()) == keys  # no renamed parameter while applied
    undo()
    assert all(modules[name] is module for name, module in model.named_modules())
    assert modules.keys() == dict(model.named_modules()).keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert checkpointed_blocks(model) == 0


def test_an_instance_forward_the_block_had_is_put_back() -> None:
    model = tiny_gpt2(num_layers=2)
    block = model.transformer.h[0]
    own = block.forward
    block.forward = own  # an instance attribute, as accelerate's hooks set one
    with activation_checkpointing_applied(model, "full"):
        assert block.forward is not own
    assert block.__dict__["forward"] is own


def test_full_checkpointing_saves_fewer_activation_bytes() -> None:
    model = tiny_gpt2()
    batch = _batch()

    def saved_bytes() -> int:
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch).loss.sum()
        return total

    plain = saved_bytes()
    with activation_checkpointing_applied(model, "full"):
        full = saved_bytes()
    with activation_checkpointing_applied(model, "selective"):
        selective = saved_bytes()
    assert full < selective < plain


def test_the_live_conditions_name_the_applied_mode() -> None:
    model = tiny_gpt2(num_layers=4)

    def described() -> str:
        return read_conditions(
            model, None, device_type="cpu", amp_dtype=None
        ).activation_checkpointing

    assert described() == "none detected"
    with activation_checkpointing_applied(model, "selective"):
        assert described() == (
            "autobatch checkpoint on 2 blocks (torch.utils.checkpoint, use_reentrant=False)"
        )
    with activation_checkpointing_applied(model, "full"):
        assert described().startswith("autobatch checkpoint on 4 blocks")
    assert described() == "none detected"


def test_bad_modes_and_blocks_are_refused_by_name() -> None:
    model = tiny_gpt2(num_layers=2)
    with pytest.raises(ConfigError, match="activation_checkpointing='most' is not a mode"):
        apply_activation_checkpointing(model, "most")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="every=0 must be an int >= 1"):
        apply_activation_checkpointing(model, "selective", every=0)
    with pytest.raises(ConfigError, match="block_class='Nope' matches no module"):
        apply_activation_checkpointing(model, "full", block_class="Nope")
    with pytest.raises(ConfigError, match="no nn.ModuleList of repeated blocks.*block_class="):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")
    undo = apply_activation_checkpointing(model, "full")
    with pytest.raises(ConfigError, match="already applied"):
        apply_activation_checkpointing(model, "selective")
    undo()
