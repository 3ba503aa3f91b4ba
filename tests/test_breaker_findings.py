"""Faults found by trying to break the newest library and CLI features (activation
checkpointing chosen with the micro-batch, tune --report, --checkpoint-block-class). Each test
states what should happen; an ``xfail(strict=True)`` one fails today."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import autobatch
import autobatch.probing._checkpointing as checkpointing
from autobatch.cli import main
from autobatch.probing import apply_activation_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Grouped(nn.Module):
    """Blocks in groups: a ModuleList of ModuleLists (pipeline stages, Mixture-of-Depths,
    hand-written grouped layers), called block by block."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = nn.ModuleList([nn.ModuleList([Block(), Block()]) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            for block in group:
                x = block(x)
        return x.sum()


def test_full_checkpointing_of_grouped_blocks_recomputes_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Grouped()
    calls: list[int] = []
    real = checkpointing.checkpoint

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpointing, "checkpoint", counted)
    undo = apply_activation_checkpointing(model, "full")
    try:
        assert checkpointing.checkpointed_blocks(model) == 6  # the blocks, not the groups
        model(torch.randn(2, 8, requires_grad=True)).backward()
    finally:
        undo()
    assert len(calls) == 6, "each block's forward runs under torch.utils.checkpoint"


def _tune(*flags: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(
            [
                *["tune", "gpt2-tiny", "--seq-len", "32", "--device", "sim:48MiB", "--no-store"],
                *["--effective-batch-size", "2", *flags],
            ]
        )
    return code, out.getvalue(), err.getvalue()


def test_a_report_that_cannot_be_written_is_an_error_in_flags(tmp_path: Path) -> None:
    # Was a FileNotFoundError traceback after the whole probe.
    code, out, err = _tune("--report", str(tmp_path / "missing" / "report.html"))
    assert code != 0
    assert "gradient_accumulation_steps" in out  # the plan was printed before
    assert "--report" in err and "Traceback" not in err


def test_a_block_class_that_matches_nothing_is_refused_whatever_the_mode() -> None:
    for mode in (
        [],
        ["--activation-checkpointing", "full"],
        ["--activation-checkpointing", "auto"],
    ):
        code, _, err = _tune("--checkpoint-block-class", "NoSuchBlock", *mode)
        assert code != 0
        assert "--checkpoint-block-class NoSuchBlock matches no module" in err


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def test_the_largest_micro_batch_honours_the_checkpointing_asked() -> None:
    plan = autobatch.autotune(
        Stack(), torch.randn(1, 8), device="sim:300KiB", use_store=False,
        activation_checkpointing="full",
    )  # fmt: skip
    assert plan.activation_checkpointing == "full"


def test_the_largest_micro_batch_probes_eval_when_asked() -> None:
    plan = autobatch.autotune(
        Stack(), torch.randn(1, 8), device="sim:300KiB", use_store=False, eval=True
    )
    assert plan.eval_micro_batch_size is not None


class Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


class EncoderDecoder(nn.Module):
    """T5, BART, Whisper: two stacks of blocks (T5's encoder.block and decoder.block)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Half()
        self.decoder = Half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x)).sum()


def test_full_checkpointing_of_an_encoder_decoder_checkpoints_both_stacks() -> None:
    model = EncoderDecoder()
    undo = apply_activation_checkpointing(model, "full")
    try:
        assert checkpointing.checkpointed_blocks(model) == 6
    finally:
        undo()


def test_a_block_class_names_blocks_whose_class_fsdp2_swapped() -> None:
    # fully_shard(block) swaps the block's class for a subclass (FSDPBlock, bases FSDPModule
    # and Block): checkpoint_block_class='Block' (or Block itself) matched nothing before.
    fsdp_block = type("FSDPBlock", (Block,), {})
    model = Stack()
    for block in model.blocks:
        block.__class__ = fsdp_block
    assert len(checkpointing.checkpointable_blocks(model, block_class="Block")) == 4
    assert len(checkpointing.checkpointable_blocks(model, block_class=Block)) == 4
