"""apply_activation_checkpointing (the mode a plan names, applied for training) makes every
training step update a checkpointed block's BatchNorm running statistics twice: the backward's
recompute runs the block's forward again in training mode. One step under "full" leaves
num_batches_tracked=2 and different running_mean/var from the same step without checkpointing,
so training with the planned mode silently changes the model (the gradients are equal)."""

import copy

import torch
from torch import nn

from autobatch.probing import apply_activation_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_checkpointed_training_step_updates_batchnorm_statistics_once() -> None:
    torch.manual_seed(0)
    plain = Model().double().train()
    checkpointed = copy.deepcopy(plain)
    x = torch.randn(6, 8, dtype=torch.float64)
    plain(x).backward()
    undo = apply_activation_checkpointing(checkpointed, "full")
    checkpointed(x).backward()
    undo()
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad)  # holds today
    for (name, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers(), strict=True):
        assert torch.equal(a, b), name  # today: num_batches_tracked 1 vs 2, running stats differ


def test_cumulative_batchnorm_under_selective_counts_each_step_once() -> None:
    torch.manual_seed(0)
    plain = Model().double().train()
    for module in plain.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.momentum = None  # a cumulative average: reads num_batches_tracked
    checkpointed = copy.deepcopy(plain)
    undo = apply_activation_checkpointing(checkpointed, "selective", every=1)
    for _ in range(2):
        x = torch.randn(6, 8, dtype=torch.float64)
        plain(x).backward()
        checkpointed(x).backward()
    undo()
    assert int(checkpointed.blocks[0].norm.num_batches_tracked) == 2
    for (name, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers(), strict=True):
        assert torch.equal(a, b), name
