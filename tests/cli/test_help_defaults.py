"""Every subcommand's --help gives a flag's default in one style, ``(default: X)``, as ``serve
--help`` does: never ``(default 0.05)``, ``default: the launcher's`` outside parentheses, nor
``none (default, ...)``."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from autobatch.cli import main
from autobatch.cli._parser import build_parser

_ANY_DEFAULT = re.compile(r"\S*\bdefault\S*(?:\s\S+)?")
"""Every mention of a default in a help text, with the words either side of it."""


def _parsers(
    parser: argparse.ArgumentParser, name: str = "autobatch"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {command}")


def _flags() -> list[tuple[str, argparse.Action]]:
    return [
        (f"{name} {action.option_strings[-1]}", action)
        for name, parser in _parsers(build_parser())
        for action in parser._actions
        if action.option_strings and action.help not in (None, argparse.SUPPRESS)
        and action.dest not in ("help", "version")
    ]  # fmt: skip


def _one_style(help_text: str) -> list[str]:
    """The mentions of a default not in the one style ``(default: X)``."""
    return [m for m in _ANY_DEFAULT.findall(help_text) if not m.startswith("(default:")]


def test_the_style_check_refuses_each_other_style() -> None:
    assert _one_style("capacity kept free (default 0.05)") == ["(default 0.05)"]
    assert _one_style("ranks; default: the launcher's, else 1") == ["default: the"]
    assert _one_style("none (default, the model as given), full") == ["(default, the"]
    assert _one_style("capacity kept free (default: 0.05)") == []


@pytest.mark.parametrize(("flag", "action"), _flags(), ids=[flag for flag, _ in _flags()])
def test_each_flag_with_a_default_shows_it_as_default_colon(
    flag: str, action: argparse.Action
) -> None:
    text = " ".join(str(action.help).split())
    assert _one_style(text) == [], f"{flag}: {text}"
    if action.default not in (None, False) and action.nargs != 0:
        shown = action.default[0] if isinstance(action.default, list) else action.default
        assert f"(default: {shown})" in text, f"{flag}: {text}"


def test_serve_help_speaks_the_same_style(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("fastapi")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000)" in text
    assert _one_style(text) == []


def test_tune_help_reads_its_defaults_in_one_style(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 0.05)", "(default: none)", "(default: auto)", "(default: text)"):
        assert shown in text
    assert "default: the launcher's, torchrun's WORLD_SIZE, Slurm's..., else 1)" in text
    assert _one_style(text) == []
