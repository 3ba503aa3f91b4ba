"""Model factories for the service's registry (``examples/models.toml``) and the CLI
(``autobatch tune examples.models:tiny_mlp --input-shape 32 ...``). Random weights."""

from __future__ import annotations

import torch


def tiny_mlp() -> torch.nn.Module:
    """32 features in, 10 classes out."""
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def gpt2_small() -> torch.nn.Module:
    """GPT-2 (124M) with random weights; its output carries ``.loss`` when given labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    # transformers picks the loss from the class name, which here names none: say it, rather than
    # have it warn "`loss_type=None` ... unrecognized" and fall back to the same loss.
    model.loss_type = "ForCausalLM"
    return model
