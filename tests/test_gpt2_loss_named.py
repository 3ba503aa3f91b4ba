"""Every GPT-2 a user meets (the examples' models, the CLI's built-in ones) names its loss, so
transformers never warns "`loss_type=None` was set in the config but it is unrecognized" on a
run the user did not configure."""

from __future__ import annotations

import logging

import pytest
import torch

from autobatch.models._zoo import load_model


def test_the_examples_gpt2_trains_without_transformers_loss_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import transformers

    from examples.models import gpt2_small

    model = gpt2_small()
    assert getattr(model, "loss_type", None) == "ForCausalLM"
    ids = torch.randint(0, 50257, (1, 8))
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    transformers.logging.enable_propagation()  # its warnings reach caplog
    try:
        with caplog.at_level(logging.WARNING):
            assert model(input_ids=ids, labels=ids).loss.item() > 0
    finally:
        transformers.logging.disable_propagation()
        transformers.logging.set_verbosity(verbosity)
    assert "loss_type" not in caplog.text


def test_the_built_in_gpt2_names_its_loss() -> None:
    assert getattr(load_model("gpt2-tiny", seq_len=8).model, "loss_type", None) == "ForCausalLM"
