"""``autobatch tune --activation-checkpointing``: the flag reaches the library, and the notes
say which modes ran and why."""

from __future__ import annotations

import pytest

from tests.cli.test_cli import run


def test_auto_says_which_modes_it_tried_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        *["tune", "gpt2-tiny", "--seq-len", "32", "--device", "sim:48MiB", "--no-store"],
        *["--effective-batch-size", "2", "--activation-checkpointing", "auto"],
    )
    assert code == 0, err
    assert "gradient_accumulation_steps  1" in out
    assert "activation_checkpointing " not in out  # none chosen: the model as given
    assert (
        "note: activation checkpointing modes tried none; skipped selective, full: the plan "
        "without checkpointing reaches the effective batch in one micro-step (micro_batch_size 2)"
    ) in out


def test_an_unknown_mode_is_refused_by_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys,
        *["tune", "gpt2-tiny", "--effective-batch-size", "2"],
        *["--activation-checkpointing", "most"],
    )
    assert code == 2
    assert "--activation-checkpointing: invalid choice: 'most'" in err
