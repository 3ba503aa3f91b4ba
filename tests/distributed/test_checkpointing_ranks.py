"""Activation checkpointing under DDP and FSDP2 (``fully_shard``) on 2 gloo ranks on CPU: the
gradient each rank holds after a checkpointed step equals the plain step's (float64, 1e-12),
in both modes, and the undo leaves the wrapped model's modules as they were."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from autobatch.probing import activation_checkpointing_applied
from autobatch.probing._checkpointing import checkpointed_blocks
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

GROUP_TIMEOUT_S = 30


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Stack(torch.nn.Module):
    """A transformer-shaped stack in plain torch (the workers need not import transformers)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Stack().double()


def _local_gradients(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(ids).backward()
    grads = []
    for param in model.parameters():
        grad = param.grad
        assert grad is not None
        grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    return [g.detach().clone() for g in grads]


def _largest_difference(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, float]:
    plain = _local_gradients(model, ids)
    modules = list(model.modules())
    found: dict[str, float] = {}
    for mode in ("selective", "full"):
        with activation_checkpointing_applied(model, mode):  # type: ignore[arg-type]
            checkpointed = _local_gradients(model, ids)
            found[f"{mode}_blocks"] = checkpointed_blocks(model)
        pairs = zip(plain, checkpointed, strict=True)
        found[mode] = max(float((a - b).abs().max()) for a, b in pairs)
    same = zip(modules, model.modules(), strict=True)
    found["same_modules"] = float(all(a is b for a, b in same))
    return found


def _worker(rank: int, world_size: int, tmp: str) -> None:
    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    result: dict[str, Any] = {}
    try:
        result["ddp"] = _largest_difference(DistributedDataParallel(_model()), ids)
        sharded = _model()
        for block in sharded.layers:
            fully_shard(block)
        fully_shard(sharded)
        result["fsdp2"] = _largest_difference(sharded, ids)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


def test_the_checkpointed_gradient_equals_the_plain_one_under_ddp_and_fsdp2(
    tmp_path: Path,
) -> None:
    spawn_and_wait(_worker, (2, str(tmp_path)), 2, timeout_s=4 * GROUP_TIMEOUT_S)
    for rank in range(2):
        result = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        for wrapper in ("ddp", "fsdp2"):
            found = result[wrapper]
            assert found["selective"] <= 1e-12, (rank, wrapper, found)
            assert found["full"] <= 1e-12, (rank, wrapper, found)
            assert found["same_modules"] == 1.0
            assert (found["selective_blocks"], found["full_blocks"]) == (2, 3)
