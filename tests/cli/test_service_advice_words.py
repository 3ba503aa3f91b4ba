"""``plan --service``: a service's advice in its body's fields (``"card": "sim"``) reads as the
command's flags (``--card sim``), for every field the command has a flag for (issue 46)."""

from __future__ import annotations

from autobatch.cli import build_parser
from autobatch.cli._wording import cli_message, command_flags, error_words
from autobatch.errors import ServiceError

PLAN = command_flags(build_parser(), "plan")


def test_the_service_advice_reads_as_plan_flags() -> None:
    exc = ServiceError(
        'no stored training profile can answer for \'a card\'; or ask for "card": "sim", '
        "which they answer as measured",
        status=422,
    )
    words = error_words(exc, build_parser(), "plan", ["plan", "--service", "http://s"])
    assert words.endswith("or ask for --card sim, which they answer as measured")
    assert cli_message('"card": "NVIDIA H100 80GB HBM3" or "sim"', PLAN) == (
        '--card "NVIDIA H100 80GB HBM3" or sim'
    )
    assert cli_message('give "device": {"capacity_bytes": 85899345920}', PLAN) == (
        "give --capacity 80GiB"
    )
    assert cli_message('"device": {"gpu_fraction": 0.5}', PLAN) == "--gpu-fraction 0.5"
    assert cli_message('"allow_inexact": true', PLAN) == "--allow-inexact"
    assert cli_message('"world_size": 8', PLAN) == "--world-size 8"


def test_a_condition_field_is_a_condition_flag_where_the_command_has_no_own_flag() -> None:
    # plan takes conditions by --condition NAME=VALUE, as the library compares them.
    assert cli_message('"activation_checkpointing": "full"', PLAN) == (
        "--condition activation_checkpointing=full"
    )
    assert cli_message('"conditions": {"amp_dtype": "bfloat16"}', PLAN) == (
        "--condition amp_dtype=bfloat16"
    )
    tune = command_flags(build_parser(), "tune")
    assert cli_message('"activation_checkpointing": "full"', tune) == (
        "--activation-checkpointing full"
    )


def test_fields_without_a_flag_and_field_lists_are_left_as_written() -> None:
    assert cli_message('the fields are "card", "device"', PLAN) == 'the fields are "card", "device"'
    assert cli_message('"node_labels": "a"', PLAN) == '"node_labels": "a"'
