"""Every message the command line prints for a bad invocation speaks in flags: no Python
keyword spelling (``world_size=N``, ``world_size <= 64``, ``plan without mixed_ranks``, ``give
device.capacity_bytes``) reaches a user of the CLI. The translation is one place
(``autobatch.cli._wording``); this table walks the refusals of every command that plans."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autobatch.cli import build_parser, main
from autobatch.cli._wording import cli_message, command_flags, error_words
from autobatch.errors import ServiceError

PYTHON_SPELLING = re.compile(
    r"(?<![\w.\-/:'\"])[a-z]+(?:_[a-z0-9]+)+(?![\w(])"  # a snake_case keyword: world_size
    r"|(?<![\w.\-])[a-z_]+=(?!=)"  # a keyword argument: world_size=, refresh=
)
"""Python's spelling of an argument, outside quotes (a model name, ``'sim:32GiB'``) and dotted
paths (``autobatch.training``)."""

PLAN = "plan --max-micro-batch-size 24"
MIXED = "plan --rank-max 24 --rank-max 12 --effective-batch-size 96"
TUNE = "tune gpt2-tiny --effective-batch-size 8 --no-store"
BAD = [
    f"{PLAN} --effective-batch-size 64 --world-size 128",
    f"{PLAN} --effective-batch-size 97 --world-size 2",
    f"{PLAN} --effective-batch-size 97 --uneven never --max-gradient-accumulation-steps 4",
    f"{PLAN} --effective-batch-size 64 --multiple-of 32",
    f"{PLAN} --effective-batch-size 97 --format deepspeed",
    f"{MIXED} --format deepspeed",
    f"{MIXED} --format hf",
    f"{PLAN} --effective-batch-size 64 --gpu-fraction 0.5",
    f"{PLAN} --effective-batch-size 64 --world-size 1,2 --env",
    f"{TUNE} --device sim:32Gb",
    f"{TUNE} --device cuda:7",
    f"{TUNE} --device sim:64MiB --max-micro-batch-size 0",
    "estimate tests.service.models:tiny_mlp --capacity 1GiB",
]


@pytest.mark.parametrize("command", BAD)
def test_no_refusal_speaks_python(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(command.split()) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"autobatch {command.split()[0]}: error: "), err
    assert PYTHON_SPELLING.findall(err) == [], err


def test_the_library_names_become_the_commands_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(f"{PLAN} --effective-batch-size 64 --world-size 128".split()) == 1
    assert capsys.readouterr().err == (
        "autobatch plan: error: argument --effective-batch-size: 64 is less than --world-size 128: "
        "every rank needs a sample; use --effective-batch-size >= 128 or --world-size <= 64\n"
        "try 'autobatch plan --help'\n"
    )
    assert main(f"{MIXED} --format deepspeed".split()) == 1
    assert "or plan without --rank-max (every rank at" in capsys.readouterr().err


def test_the_translation_is_by_each_commands_own_flags() -> None:
    parser = build_parser()
    plan, tune = command_flags(parser, "plan"), command_flags(parser, "tune")
    assert cli_message("plan without mixed_ranks", plan) == "plan without --rank-max"
    assert cli_message("plan without mixed_ranks", tune) == "plan without --mixed-ranks"
    assert cli_message("give device.capacity_bytes", plan) == "give --capacity"
    assert cli_message("use amp_dtype=torch.bfloat16", tune) == "use --amp bf16"
    assert cli_message("probe again with refresh=True", tune) == "probe again with --refresh"
    assert cli_message("use uneven='never'", plan) == "use --uneven never"
    # English words and dotted Python paths stay; a name the command has no flag for stays.
    kept = "a larger device, autobatch.training.Accumulator, or the model's input_ids"
    assert cli_message(kept, tune) == kept


def test_a_refused_token_names_the_variable_the_cli_reads_it_from() -> None:
    refused = ServiceError(
        "POST /v1/plan: missing or wrong bearer token: send one Authorization: Bearer <token>",
        status=401,
    )
    words = error_words(refused, build_parser(), "plan", [])
    assert words.endswith("; set AUTOBATCH_API_TOKEN to a token the service accepts")


def test_a_budget_from_a_flag_is_named_as_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / "s.sqlite3")
    tuned = ["--store", store, "tune", "tests.service.models:tiny_mlp", "--input-shape", "32"]
    assert main([*tuned, "--device", "sim:4MiB", "--effective-batch-size", "8", "--json"]) == 0
    profile_id = _only_profile(capsys, store)
    planned = ["--store", store, "plan", "--profile", profile_id, "--effective-batch-size", "8"]
    assert main([*planned, "--capacity", "8MiB", "--gpu-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "memory budget                4.00 MiB, decided by --gpu-fraction" in out
    assert "  --capacity                 8.00 MiB usable of 8.00 MiB" in out
    assert PYTHON_SPELLING.findall(out.split("memory budget")[1]) == []


def _only_profile(capsys: pytest.CaptureFixture[str], store: str) -> str:
    capsys.readouterr()
    assert main(["--store", store, "profiles", "list", "--json"]) == 0
    import json

    (row,) = json.loads(capsys.readouterr().out)
    return str(row["id"])


def test_a_quoted_name_is_a_value_the_message_quotes_not_a_flag() -> None:
    # The conditions a plan may name include 'world_size': a condition, asked as
    # --condition world_size=8, never the --world-size flag.
    flags = command_flags(build_parser(), "plan")
    text = "unknown condition(s) 'foo': name conditions from 'amp_dtype', 'world_size'"
    assert cli_message(text, flags) == text
    assert cli_message("use world_size=8", flags) == "use --world-size 8"
