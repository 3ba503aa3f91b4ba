"""Errors carry their remedies as data; each surface words them (here: Python's wording)."""

from __future__ import annotations

import re

import pytest

from autobatch.errors import (
    AutobatchError,
    ConfigError,
    DoesNotFitError,
    Remedy,
    python_wording,
    with_remedies,
)
from tests.planning.test_planner import plan

INEXACT = Remedy(parameter="allow_inexact", values=(True,), purpose="plan the nearest")


@pytest.mark.parametrize(
    ("remedy", "python"),
    [
        (INEXACT, "allow_inexact=True (plan the nearest)"),
        (
            Remedy(parameter="effective_batch_size", values=(96, 100)),
            "effective_batch_size=96 or 100",
        ),
        (
            Remedy(parameter="amp_dtype", values=("bfloat16",), purpose="reduced precision"),
            "amp_dtype=torch.bfloat16 (reduced precision)",
        ),
        (Remedy(purpose="a larger device"), "a larger device"),
    ],
)
def test_python_wording(remedy: Remedy, python: str) -> None:
    assert python_wording(remedy) == python


@pytest.mark.parametrize(
    ("num_remedies", "text"),
    [
        (0, "too big"),
        (1, "too big; use a"),
        (2, "too big; use a, or b"),
        (3, "too big; use a, b, or c"),
    ],
)
def test_remedies_join_after_the_reason(num_remedies: int, text: str) -> None:
    remedies = [Remedy(purpose=name) for name in "abc"[:num_remedies]]
    assert with_remedies("too big", remedies, python_wording) == text
    error = ConfigError("too big", remedies=remedies)
    assert str(error) == text
    assert error.message == "too big"


def test_each_surface_words_the_remedies_through_describe() -> None:
    error = ConfigError("too big", remedies=(INEXACT, Remedy(purpose="a larger device")))
    flags = {"allow_inexact": "--allow-inexact"}
    worded = error.describe(lambda remedy: flags.get(remedy.parameter, remedy.purpose))
    assert worded == "too big; use --allow-inexact, or a larger device"
    assert str(error) == "too big; use allow_inexact=True (plan the nearest), or a larger device"


@pytest.mark.parametrize(
    "fields",
    [{}, {"parameter": "allow_inexact"}, {"values": (1,), "purpose": "x"}],
)
def test_a_remedy_needs_a_parameter_and_values_or_a_purpose(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="needs a parameter and values, or a purpose alone"):
        Remedy(**fields)  # type: ignore[arg-type]


def test_subclasses_keep_their_fields_and_take_remedies() -> None:
    error = DoesNotFitError(
        "no room",
        device_name="sim",
        capacity_bytes=10,
        required_bytes=20,
        static_bytes=5,
        remedies=(Remedy(purpose="a larger device"),),
    )
    assert isinstance(error, AutobatchError)
    assert (error.capacity_bytes, error.required_bytes) == (10, 20)
    assert str(error) == "no room; use a larger device"


def test_not_a_multiple_is_structured_and_names_the_cause() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("97 is not a multiple of world_size 4")
    ) as info:
        plan(24, effective_batch_size=97, world_size=4)
    assert info.value.message == "effective_batch_size 97 is not a multiple of world_size 4"
    assert info.value.remedies == (
        Remedy(parameter="effective_batch_size", values=(96, 100)),
        INEXACT,
    )


def test_inexact_note_names_the_real_cause_not_the_step_cap() -> None:
    result = plan(24, effective_batch_size=97, world_size=4, allow_inexact=True)
    assert result.effective_batch_size == 96
    assert result.notes == (
        "effective_batch_size 97 is not a multiple of world_size 4; planned the nearest, 96",
        "effective_batch_size 96 = 24 (micro_batch_size) x 1 (gradient_accumulation_steps) x 4 "
        "(data-parallel ranks)",
    )


def test_device_unavailable_keeps_its_reason_code() -> None:
    # DeviceUnavailableError.reason is a stable code; the remedy-free text is ``message``.
    from autobatch.errors import DeviceUnavailableError

    error = DeviceUnavailableError("no driver", reason="driver_not_loaded")
    assert (error.reason, error.message, str(error)) == (
        "driver_not_loaded",
        "no driver",
        "no driver",
    )
