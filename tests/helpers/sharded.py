"""A small FSDP2 model the multi-process tests share (``fully_shard`` needs an initialised
process group, so it is built inside each rank's worker)."""

from __future__ import annotations

import torch


def sharded_mlp() -> torch.nn.Module:
    """Three ``fully_shard`` blocks of Linear(64, 256) -> ReLU -> Linear(256, 64), then a
    Linear(64, 10) head, the whole model sharded too; seeded, so every rank builds the same."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        for _ in range(3)
    ]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 10))
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model
