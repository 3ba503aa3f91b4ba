"""The service words a library error's remedies as the request's JSON fields."""

from __future__ import annotations

import pytest

from autobatch.errors import ConfigError, Remedy
from service.web.wording import describe, field_wording


@pytest.mark.parametrize(
    ("remedy", "worded"),
    [
        (
            Remedy(parameter="allow_inexact", values=(True,), purpose="plan the nearest"),
            '"allow_inexact": true (plan the nearest)',
        ),
        (
            Remedy(parameter="effective_batch_size", values=(96, 100)),
            '"effective_batch_size": 96 or 100',
        ),
        # No request or registry entry sets autocast: its purpose, not a Python argument.
        (
            Remedy(parameter="amp_dtype", values=("bfloat16",), purpose="reduced precision"),
            "reduced precision",
        ),
        # A profile's mode is no request field either (plan from a training profile).
        (
            Remedy(parameter="eval", values=(False,), purpose="a training profile"),
            "a training profile",
        ),
        (Remedy(purpose="a larger device"), "a larger device"),
        # A request sets the device's memory inside its device.
        (
            Remedy(parameter="capacity_bytes", values=(85899345920,), purpose="80 GiB"),
            '"device": {"capacity_bytes": 85899345920} (80 GiB)',
        ),
    ],
)
def test_field_wording(remedy: Remedy, worded: str) -> None:
    assert field_wording(remedy) == worded


def test_describe_words_library_errors_and_leaves_others_alone() -> None:
    error = ConfigError("97 is not a multiple of 4", remedies=(Remedy(purpose="a larger device"),))
    assert describe(error) == "97 is not a multiple of 4; use a larger device"
    assert describe(ValueError("plain")) == "plain"
