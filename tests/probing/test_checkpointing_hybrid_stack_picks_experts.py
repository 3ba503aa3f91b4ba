"""checkpointable_blocks on a hybrid stack (layers alternating two classes, as Jamba's attention
and Mamba layers, or dense and MoE layers) finds no stack at the layers and descends into them,
returning every MoE expert Linear and the model's output heads (ModuleLists of 2+ Linears) as
the "repeated blocks". activation_checkpointing="full"/"auto" then checkpoints single Linears
(no activation saved) and the output heads, never the layers, and the plan says "full". It
should find the layers, or refuse with the block_class= remedy as for a model without blocks."""

import pytest
import torch
from torch import nn

from autobatch.errors import ConfigError
from autobatch.probing import checkpointable_blocks


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(expert(x) for expert in self.experts)


class Hybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(), MoE(), Attention(), MoE()])
        self.heads = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return sum(head(x) for head in self.heads).sum()


def test_hybrid_stack_blocks_are_its_layers_or_refused() -> None:
    model = Hybrid()
    try:
        blocks = checkpointable_blocks(model)
    except ConfigError:
        return  # refused, naming block_class=: fine
    layers = {id(layer) for layer in model.layers}
    assert all(id(block) in layers for block in blocks), [type(b).__name__ for b in blocks]


def test_hybrid_stack_is_found_as_one_stack_of_mixed_layers() -> None:
    model = Hybrid()
    assert checkpointable_blocks(model) == list(model.layers)  # never the experts or the heads


def test_a_list_of_single_linears_alone_is_refused_naming_block_class() -> None:
    model = nn.Module()
    model.heads = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])
    with pytest.raises(ConfigError, match="block_class="):
        checkpointable_blocks(model)
