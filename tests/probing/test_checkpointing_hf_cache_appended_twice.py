"""Under apply_activation_checkpointing (what a plan's "full"/"selective" tells a script to call,
and what the probe measures), a Hugging Face decoder trained with its default use_cache=True
appends every layer's keys/values to the returned DynamicCache twice: once in forward, again in
the backward's recompute (the cache is updated in place). After one step the cache says 32
tokens for a 16-token input. Hugging Face's own gradient_checkpointing turns use_cache off for
this; autobatch's checkpointing neither does nor refuses, and the probe's memory includes the
doubled cache (K/V of every layer kept beside the checkpointed activations)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch.probing import (  # noqa: E402
    activation_checkpointing_applied,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)


def test_checkpointed_step_leaves_the_cache_as_the_plain_step_does() -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))
    plain = model(input_ids=ids, labels=ids)
    plain.loss.backward()
    undo = apply_activation_checkpointing(model, "full")
    try:
        checkpointed = model(input_ids=ids, labels=ids)
        assert model.config.use_cache is False  # as Hugging Face's own gradient checkpointing
        checkpointed.loss.backward()
    finally:
        undo()
    assert plain.past_key_values.get_seq_length() == 16
    assert checkpointed.past_key_values is None  # no cache kept, none appended twice
    assert model.config.use_cache is True  # the undo turned it back on


def test_cache_asked_for_is_not_appended_by_the_recompute() -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))
    apply_activation_checkpointing(model, "full")  # a drop-in's way: no undo kept
    out = model(input_ids=ids, labels=ids, use_cache=True)  # asked for in the call
    out.loss.backward()
    cache = out.past_key_values
    assert cache is None or cache.get_seq_length() == 0  # the checkpointed layers got none
    assert remove_activation_checkpointing(model) == 2
    assert model.config.use_cache is True  # turned back on by the removal too
    with activation_checkpointing_applied(model, "selective"):
        assert model.config.use_cache is False
    assert model.config.use_cache is True
