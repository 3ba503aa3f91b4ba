"""The CLI's flag set, pinned: a flag added, renamed or removed is a deliberate change here."""

from __future__ import annotations

import argparse

from autobatch.cli import build_parser

FLAGS = {
    "": ["--help", "--store", "--version", "-h"],
    "devices": ["--help", "--json", "-h"],
    "launcher": ["--help", "--json", "--slurm-task-ranks", "--world-size", "-h"],
    "estimate": [
        "--amp",
        "--capacity",
        "--help",
        "--image-size",
        "--input-shape",
        "--json",
        "--max-micro-batch-size",
        "--safety-margin",
        "--seq-len",
        "-h",
        "model",
    ],
    "plan": [
        "--allow-inexact",
        "--capacity",
        "--card",
        "--condition",
        "--data-parallel-size",
        "--effective-batch-size",
        "--env",
        "--format",
        "--gpu-fraction",
        "--help",
        "--json",
        "--max-gradient-accumulation-steps",
        "--max-micro-batch-size",
        "--model-fingerprint",
        "--multiple-of",
        "--node",
        "--output",
        "--profile",
        "--rank-max",
        "--rank-seconds-per-sample",
        "--service",
        "--uneven",
        "--world-size",
        "-h",
    ],
    "profiles": ["--help", "-h"],
    "profiles delete": ["--help", "-h", "profile_id"],
    "profiles list": ["--help", "--json", "-h"],
    "profiles show": ["--help", "--json", "-h", "profile_id"],
    "serve": [],
    "tune": [
        "--activation-checkpointing",
        "--allow-inexact",
        "--amp",
        "--checkpoint-block-class",
        "--data-parallel-size",
        "--device",
        "--effective-batch-size",
        "--eval",
        "--format",
        "--gpu-fraction",
        "--help",
        "--image-size",
        "--input-shape",
        "--json",
        "--max-gradient-accumulation-steps",
        "--max-micro-batch-size",
        "--mixed-ranks",
        "--multiple-of",
        "--no-store",
        "--refresh",
        "--report",
        "--report-to",
        "--safety-margin",
        "--seq-len",
        "--uneven",
        "--world-size",
        "-h",
        "model",
    ],
}


def _flags(parser: argparse.ArgumentParser, command: tuple[str, ...] = ()) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    own: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_flags(sub, (*command, name)))
        elif action.option_strings:
            own.extend(action.option_strings)
        else:
            own.append(action.dest)
    found[" ".join(command)] = sorted(own)
    return found


def test_every_command_has_exactly_the_pinned_flags() -> None:
    assert _flags(build_parser()) == FLAGS


def _parsers(
    parser: argparse.ArgumentParser, command: tuple[str, ...] = ()
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(" ".join(command) or "autobatch", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, (*command, name))
    return found


def test_every_argument_and_command_has_help() -> None:
    missing = []
    for command, parser in _parsers(build_parser()):
        for action in parser._actions:
            name = "/".join(action.option_strings) or action.dest
            if not action.help:
                missing.append(f"{command}: {name}")
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{command} {a.dest}" for a in action._choices_actions if not a.help]
    assert missing == []


def test_the_uneven_help_says_what_how_it_works_says() -> None:
    # The rule (autobatch.planning's choose_steps): auto goes unequal past twice the fewest steps.
    from pathlib import Path

    docs = Path(__file__).parents[2].joinpath("docs", "how-it-works.md").read_text()
    (row,) = [line for line in docs.splitlines() if '`uneven="auto"`' in line]
    helps = {
        command: action.help or ""
        for command, parser in _parsers(build_parser())
        for action in parser._actions
        if "--uneven" in action.option_strings
    }
    assert set(helps) >= {"plan", "tune"}
    for phrase in (
        "unequal micro-batches, differing by at most 1",
        "each loss weighted by its size",
        "when equal sizes would need more than twice the fewest accumulation steps",
        "(equal sizes only)",
        "(the fewest steps)",
    ):
        assert phrase in row
        assert all(phrase in help_text for help_text in helps.values()), (phrase, helps)
