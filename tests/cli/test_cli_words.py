"""The command line's words for what the library and the service say in Python: flags for
arguments, human sizes for bytes, plain words for recorded conditions, lists as typed."""

from __future__ import annotations

import pytest

from autobatch.cli import main
from autobatch.cli._output import note_flags
from autobatch.cli._wording import (
    FLAGS,
    cli_message,
    condition_words,
    reason_words,
    size_spelling,
)

PLAN = ["plan", "--max-micro-batch-size", "24"]


def test_the_world_size_table_words_its_refusals_as_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*PLAN, "--world-size", "1,2", "--effective-batch-size", "97"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.split(None, 3)[3] == (
        "--effective-batch-size 97 is not a multiple of --world-size 2; use "
        "--effective-batch-size 96 or 98, or --allow-inexact (plan the nearest)"
    )


def test_a_list_flag_given_twice_is_shown_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(
            [
                *PLAN,
                "--effective-batch-size",
                "96",
                "--world-size",
                "2",
                "--data-parallel-size",
                "4,8",
            ]
        )
    assert capsys.readouterr().err.splitlines()[0] == (
        "autobatch plan: error: --data-parallel-size 4,8 disagrees with --world-size 2: "
        "--world-size and --data-parallel-size are one setting; give it once"
    )


def test_bytes_and_bare_keywords_become_the_flags_a_user_types() -> None:
    flags = note_flags()
    text = (
        "the model needs 2.14 GiB (2299894272 bytes) at micro-batch size 1, more than the "
        "972.80 MiB usable of capacity_bytes 1073741824 with safety_margin 0.05; use a larger "
        "device"
    )
    assert cli_message(text, flags) == (
        "the model needs 2.14 GiB (2299894272 bytes) at micro-batch size 1, more than the "
        "972.80 MiB usable of --capacity 1GiB with --safety-margin 0.05; use a larger device"
    )
    assert "checkpoint_block_class" not in cli_message(
        "name the class with checkpoint_block_class= (e.g. checkpoint_block_class='Block')",
        flags,
        bare=False,
    )
    assert cli_message("with checkpoint_block_class= (e.g.", flags, bare=False) == (
        "with --checkpoint-block-class (e.g."
    )
    assert [size_spelling(n) for n in (2**30, 3 * 2**29, 1000)] == ["1GiB", "1536MiB", "1000"]


def test_recorded_conditions_read_as_words() -> None:
    under = {
        "torch_version": "2.13.0+cpu",
        "device_type": "sim",
        "amp_dtype": "off",
        "world_size": "1",
    }
    words = ", ".join(condition_words(name, value) for name, value in under.items())
    assert words == "torch 2.13.0+cpu, device sim, no AMP, world size 1"
    assert condition_words("amp_dtype", "bfloat16") == "AMP bf16"


def test_unequal_micro_batches_in_the_table_read_as_counts_not_a_product(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 97 on one rank, at most 24: 2 micro-batches of 20 and 3 of 19, never "20x19".
    assert main([*PLAN, "--world-size", "1,2", "--effective-batch-size", "97"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["1", "2x20+3x19", "5"]
    assert lines[-1] == (
        "micro-batch: one rank's micro-batches per optimizer step; 2x20+3x19 is 2 micro-batches "
        "of 20 and 3 of 19, each loss weighted by its size"
    )
    assert main([*PLAN, "--world-size", "1,2", "--effective-batch-size", "96"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["1", "24", "4"] and "micro-batch:" not in out


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        (
            "measured under other conditions: amp_dtype: recorded 'float16', asked 'bfloat16'",
            "measured under other conditions: AMP: recorded fp16, asked bf16",
        ),
        (
            "measured under other conditions: torch_version: not recorded, asked '2.13.0'",
            "measured under other conditions: torch: not recorded, asked 2.13.0",
        ),
        (
            "measured under other conditions: optimizer: recorded 'AdamW', asked 'SGD'",
            "measured under other conditions: optimizer: recorded AdamW, asked SGD",
        ),
        (
            "measured on NVIDIA A100 80GB PCIe (node a-1), not NVIDIA H100 80GB HBM3",
            "measured on NVIDIA A100 80GB PCIe (node a-1), not NVIDIA H100 80GB HBM3",
        ),
    ],
)
def test_a_plans_reasons_name_conditions_in_words(reason: str, words: str) -> None:
    assert reason_words(reason) == words


def test_the_world_size_table_heads_its_columns_in_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*PLAN, "--world-size", "1,2,4,8", "--effective-batch-size", "97"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "world size  micro-batch  accumulation steps  note"
    assert lines[1].split() == ["1", "2x20+3x19", "5"]
    assert "_" not in lines[0] and "micro_batch" not in lines[-1]


def test_the_rank_max_plan_words_its_loss_weight_formula(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--rank-max", "24,16", "--effective-batch-size", "80"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "max", "micro-batch"]
    assert (
        "note: ranks train micro-batches of different sizes: weight each micro-batch's mean loss "
        "by world size x micro-batch size / effective batch size (2 x micro-batch size / 80), "
        "not 1 / 2, so the gradient averaged over ranks equals the full batch's"
    ) in lines


@pytest.mark.parametrize(
    ("python", "words"),
    [
        (
            "autobatch checkpoint on 2 blocks (torch.utils.checkpoint, use_reentrant=False)",
            "autobatch checkpoint on 2 blocks (torch.utils.checkpoint, non-reentrant "
            "checkpointing)",
        ),
        (
            "Hugging Face gradient_checkpointing on 2 modules "
            "(torch.utils.checkpoint.checkpoint, use_reentrant=True)",
            "Hugging Face gradient_checkpointing on 2 modules "
            "(torch.utils.checkpoint.checkpoint, reentrant checkpointing)",
        ),
    ],
)
def test_checkpointing_keywords_read_as_words(python: str, words: str) -> None:
    # A recorded condition, a plan's reason and any library message alike.
    recorded = condition_words("activation_checkpointing", python)
    assert recorded == f"activation checkpointing {words}"
    assert cli_message(python, note_flags(), bare=False) == words
    mismatch = f"activation_checkpointing: recorded '{python}', asked 'none'"
    assert reason_words(mismatch) == f"activation checkpointing: recorded {words}, asked none"


def test_a_budget_warning_names_no_json_field() -> None:
    warning = (
        "the plan's predicted peak 3.00 GiB is more than the 2.00 GiB free now: it fits only "
        "once other processes release their memory (fits_now is false)"
    )
    assert cli_message(warning, FLAGS).endswith("release their memory (fits now: no)")
