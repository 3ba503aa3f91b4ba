"""The command line's parsing errors: one line naming the nearest flag or where a flag goes, and
one pointer to --help, never the whole usage; exit status 2."""

from __future__ import annotations

import pytest

from autobatch.cli import main
from autobatch.planning import MAX_GRADIENT_ACCUMULATION_STEPS

TUNE = ["tune", "gpt2", "--device", "sim:3GiB"]
PLAN = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64"]


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            [*TUNE, "--effective-batchsize", "96"],
            "autobatch tune: error: unknown option --effective-batchsize; "
            "did you mean --effective-batch-size?",
        ),
        (
            [*TUNE, "--seqlen", "128", "--effective-batch-size", "96"],
            "autobatch tune: error: unknown option --seqlen; did you mean --seq-len?",
        ),
        (
            [*PLAN, "--multipleof=8"],
            "autobatch plan: error: unknown option --multipleof; did you mean --multiple-of?",
        ),
        (
            ["profiles", "list", "--store", "x.sqlite3"],
            "autobatch profiles list: error: --store goes before the command: "
            "autobatch --store x.sqlite3 profiles list ...",
        ),
        (
            [*PLAN, "--store=x.sqlite3"],
            "autobatch plan: error: --store goes before the command: "
            "autobatch --store=x.sqlite3 plan ...",
        ),
        (
            ["--stroe", "x.sqlite3", "profiles", "list"],
            "autobatch: error: unknown option --stroe; did you mean --store?",
        ),
        (
            ["tnue", "gpt2"],
            "autobatch: error: argument COMMAND: invalid choice: 'tnue' (choose from 'devices', "
            "'estimate', 'tune', 'plan', 'launcher', 'profiles', 'serve'); did you mean 'tune'?",
        ),
        ([*PLAN, "96"], "autobatch plan: error: unexpected argument: 96"),
    ],
    ids=[
        "typo",
        "seqlen",
        "equals",
        "global-after",
        "global-after-equals",
        "global",
        "command",
        "stray",
    ],
)
def test_a_parse_error_is_one_line_and_a_pointer_to_help(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    prog = line.partition(": error")[0]
    assert parse_error(capsys, *argv) == f"{line}\ntry '{prog} --help'\n"


def test_a_flag_without_a_near_one_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, "devices", "--frobnicate")
    assert err.splitlines()[0] == (
        "autobatch devices: error: unknown option --frobnicate; the flags are --help, --json"
    )


def test_a_value_error_keeps_argparse_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, "plan", "--max-micro-batch-size", "x", "--effective-batch-size", "8")
    assert err.splitlines() == [
        "autobatch plan: error: argument --max-micro-batch-size: 'x' is not a whole number",
        "try 'autobatch plan --help'",
    ]


def test_profiles_help_lists_its_actions_with_one_line_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["profiles", "--help"])
    out = capsys.readouterr().out
    for action, text in [
        ("list", "one line per stored profile, newest first"),
        ("show", "one profile, in words (JSON with --json)"),
        ("delete", "remove one profile from the store"),
    ]:
        assert any(line.split(None, 1) == [action, text] for line in out.splitlines()), action


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            [*PLAN, "--world-size", "3"],
            "autobatch plan: error: argument --effective-batch-size: 64 is not a multiple of "
            "--world-size 3; use --effective-batch-size 63 or 66, or --allow-inexact (plan the "
            "nearest)",
        ),
        (
            [*PLAN, "--capacity", "1GiB"],
            "autobatch plan: error: --capacity needs --profile (a measured memory line to scale)",
        ),
    ],
    ids=["world-size", "capacity"],
)
def test_a_refusal_after_parsing_reads_as_argparses_own(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    # One format for every refusal of a command's input: its prefix and the pointer to --help.
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"{line}\ntry 'autobatch plan --help'\n")


def test_the_accumulation_bound_is_one_number_in_help_and_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No "(default: no bound)" beside an error naming a bound: both name the planner's own.
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "the most accumulation steps per optimizer step (default: the planner's own bound, "
        "1,048,576 steps)" in help_text
    )
    assert MAX_GRADIENT_ACCUMULATION_STEPS == 1_048_576  # the number the words give
    argv = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "1000000007"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        "at most 1,048,576 accumulation steps (the planner's own bound); nearest reachable "
        "--effective-batch-size: 25165824"
    ) in err
    assert "MAX_GRADIENT_ACCUMULATION_STEPS" not in help_text + err  # a Python name, not words
    # A bound the user gave is named as theirs.
    assert main([*argv[:-1], "1000", "--max-gradient-accumulation-steps", "4"]) == 1
    err = capsys.readouterr().err
    assert "at most 4 accumulation steps;" in err and "own bound" not in err
