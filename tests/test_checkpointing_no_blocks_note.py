"""activation_checkpointing="auto" on a model with no repeated blocks (a tiny MLP): only "none"
can run, and the plan's note says so, not "step times were not measured for every mode"."""

import torch
from torch import nn

from autobatch.tuning import TuneRequest, tune_request


def test_a_model_without_blocks_says_only_none_was_tried() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    tuned = tune_request(
        TuneRequest.build(
            model, torch.randn(1, 8), effective_batch_size=64, device="sim:64KiB",
            use_store=False, use_estimate=False, activation_checkpointing="auto",
            loss_fn=lambda out: out.pow(2).mean(),
        )
    )  # fmt: skip
    assert tuned.checkpointing is not None and tuned.checkpointing.tried == ("none",)
    notes = [n for n in tuned.plan.notes if n.startswith("activation checkpointing")]
    assert notes[0] == (
        "activation checkpointing none: the model has no repeated blocks to checkpoint, so "
        "only none was tried"
    )
    assert notes[1].startswith("activation checkpointing modes tried none; skipped selective, ")
    assert "nothing to checkpoint" in notes[1] and "checkpoint_block_class=" in notes[1]
    assert not any("not measured for every mode" in n for n in notes)
