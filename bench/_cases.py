"""The benchmarks' model cases: a model, its sample and how its step is formed, built fresh and
seeded for every tool alike. ``TINY_CASES`` run on simulated cards (the same models and samples
as ``tests/conftest.py``'s ``MODEL_CASES``); :func:`real_cases` are full-size models for a real
GPU (``bench/gpu_check.py``).

Example::

    model, sample, optimizer = TINY_CASES[0].build(torch.device("cpu"))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from autobatch.probing import LossFn

__all__ = ["GIB", "MIB", "TINY_CASES", "Case", "real_cases"]

GIB = 2**30
MIB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """A model, its sample and how its step is formed; :meth:`build` gives fresh, seeded copies."""

    name: str
    build_model: Callable[[], torch.nn.Module]
    build_sample: Callable[[], Any]
    """Returns one sample batch on the CPU (a few rows; micro-batches tile it)."""
    loss_fn: LossFn | None = None
    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = lambda m: (
        torch.optim.AdamW(m.parameters())
    )
    capacities_bytes: tuple[int, ...] = ()
    """Simulated capacities this case is benchmarked at (tiny cases only)."""

    def build(self, device: torch.device) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
        """Model (on ``device``), sample (on ``device``) and optimizer, seeded identically."""
        torch.manual_seed(0)
        model = self.build_model().to(device)
        sample = _to(self.build_sample(), device)
        return model, sample, self.build_optimizer(model)


def _to(batch: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch
    )


# -- model cases ---------------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config notes such as "loss_type=None ... unrecognized"


def _gpt2(**config: Any) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    # Token ids of the default config lie outside a tiny vocabulary; unset them.
    return GPT2LMHeadModel(GPT2Config(bos_token_id=None, eos_token_id=None, **config))


def _bert(**config: Any) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**config))


def _vit(**config: Any) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(**config))


def _tokens(rows: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length))
    return {"input_ids": ids, "labels": ids}


def _classified_tokens(rows: int, length: int, vocab: int, labels: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, vocab, (rows, length)),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": torch.randint(0, labels, (rows,)),
    }


TINY_CASES: tuple[Case, ...] = (
    # Same models and samples as tests/conftest.py's MODEL_CASES. Capacities are round numbers
    # (not derived from the estimator) giving maxima of roughly 20 and 50 (MLP: 52 and 117).
    Case(
        name="mlp-adam",
        build_model=_mlp,
        build_sample=lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))),
        loss_fn=F.cross_entropy,
        build_optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        capacities_bytes=(MIB * 3 // 10, MIB // 2),
    ),
    Case(
        name="cnn-batchnorm",
        build_model=_cnn,
        build_sample=lambda: (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))),
        loss_fn=F.cross_entropy,
        build_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        capacities_bytes=(2 * MIB, 5 * MIB),
    ),
    Case(
        name="gpt2-tiny",
        build_model=lambda: _gpt2(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64),
        build_sample=lambda: _tokens(2, 32, 256),
        capacities_bytes=(16 * MIB, 32 * MIB),
    ),
    Case(
        name="bert-tiny",
        build_model=lambda: _bert(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
            num_labels=3,
        ),
        build_sample=lambda: _classified_tokens(2, 32, 256, 3),
        capacities_bytes=(8 * MIB, 16 * MIB),
    ),
    Case(
        name="vit-tiny",
        build_model=lambda: _vit(
            image_size=32,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            num_labels=10,
        ),
        build_sample=lambda: {
            "pixel_values": torch.randn(2, 3, 32, 32),
            "labels": torch.randint(0, 10, (2,)),
        },
        capacities_bytes=(4 * MIB, 8 * MIB),
    ),
)


def real_cases(seq_len: int = 512) -> tuple[Case, ...]:
    """Real-size models with random weights (for a GPU): GPT-2 124M and BERT-base at ``seq_len``."""
    return (
        Case(
            name=f"gpt2-124m@{seq_len}",
            build_model=lambda: _gpt2(n_positions=max(1024, seq_len)),
            build_sample=lambda: _tokens(2, seq_len, 50257),
        ),
        Case(
            name=f"bert-base@{seq_len}",
            build_model=lambda: _bert(max_position_embeddings=max(512, seq_len), num_labels=2),
            build_sample=lambda: _classified_tokens(2, seq_len, 30522, 2),
        ),
    )
