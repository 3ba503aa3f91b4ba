"""An error's remedy names only a flag the invoked command has, taking a value only where the
flag takes one: ``devices`` has no ``--device``, ``launcher --world-size`` is a switch (issue
46); such a remedy reads in plain words."""

from __future__ import annotations

import os

import pytest

from autobatch.cli import build_parser
from autobatch.cli._wording import cli_message, command_flags, error_words
from autobatch.errors import ConfigError, Remedy
from tests.cli.test_cli import run

DEVICE = Remedy(parameter="device", values=("cpu", "sim:SIZE"), purpose="without a GPU")


def test_a_remedy_the_command_has_no_flag_for_is_plain_words() -> None:
    exc = ConfigError("no GPU", remedies=[DEVICE])
    words = error_words(exc, build_parser(), "devices", ["devices"])
    assert words == "no GPU; use device cpu or sim:SIZE (without a GPU)"
    assert error_words(exc, build_parser(), "tune", ["tune"]) == (
        "no GPU; use --device cpu or sim:SIZE (without a GPU)"
    )


def test_a_switch_is_never_given_a_value(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "environ", {"WORLD_SIZE": "x"})
    code, _, err = run(capsys, "launcher")
    assert code == 1
    assert "--world-size" not in err
    assert err.splitlines()[0].endswith(
        "use an environment without WORLD_SIZE, or world size N (the number of data-parallel "
        "ranks that train)"
    )
    launcher = command_flags(build_parser(), "launcher")
    assert "--world-size" in launcher.switches
    assert cli_message("give world_size=16", launcher) == "give world_size=16"
    assert cli_message("give world_size=16", command_flags(build_parser(), "plan")) == (
        "give --world-size 16"
    )
