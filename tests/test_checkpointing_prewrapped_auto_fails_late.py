"""A model whose blocks the user already checkpointed with autobatch's own
apply_activation_checkpointing (e.g. a training script that applies plan.activation_checkpointing,
then tunes again with activation_checkpointing="auto") is probed in full as given, and only then,
when "auto" applies "selective", fails with ConfigError "already applied": the plain probe's
real trials are spent and no plan comes back. The request is checked up front
(CheckpointingRequest.build looks at the blocks already): it is refused before any step runs."""

import pytest
import torch
from torch import nn

import autobatch
from autobatch.errors import ConfigError
from autobatch.probing import apply_activation_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 512), nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(8)])
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_auto_on_an_already_checkpointed_model_plans_or_refuses_before_probing() -> None:
    model = Model()
    undo = apply_activation_checkpointing(model, "full")
    try:
        with pytest.raises(ConfigError, match="already has autobatch's activation checkpointing"):
            autobatch.autotune(
                model, torch.randn(1, 512, 64), effective_batch_size=64,
                activation_checkpointing="auto", device="sim:100MiB", use_store=False,
            )  # fmt: skip
        assert model.calls == 0, f"refused after {model.calls} forward passes of probing"
    finally:
        undo()
