"""What a node says must add up (planning._arrival): its line at its maximum within its memory,
its fitting trials within its card, its card's memory within autobatch's catalogue, and a card
the catalogue does not hold only as NVML reported it, marked as such."""

from __future__ import annotations

from typing import Any

import pytest

from autobatch.device import BudgetReading, catalogue_memory_bytes, combine_budget
from autobatch.planning import ARRIVAL_TOLERANCE, check_arrival, uncatalogued_note
from autobatch.profile import MemoryModel, Profile, StepIdentity, Trial

GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"


def profile(**changes: Any) -> Profile:
    fields: dict[str, Any] = {
        "max_micro_batch_size": 64,
        "recommended_micro_batch_size": 60,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (
            Trial(micro_batch_size=64, fits=True, peak_allocated_bytes=36 * GIB),
            Trial(micro_batch_size=80, fits=False, oom=True, error="OutOfMemoryError"),
        ),
        "num_steps": 3,
        "device_name": H100,
        "device_type": "cuda",
        "total_memory_bytes": 81559 << 20,
        "capacity_bytes": 79 * GIB,
        "memory_model": MemoryModel(fixed_bytes=4 * GIB, bytes_per_sample=GIB // 2),
        "node_name": "node-a",
    }
    fields.update(changes)
    return Profile(**fields, identity=StepIdentity(model_fingerprint="fp"))


def fields(found: Any) -> list[str]:
    return [each.field for each in found]


def test_a_profile_that_adds_up_passes() -> None:
    assert check_arrival(profile()) == ()
    # A line that reaches just within the tolerance past the capacity still adds up.
    edge = int(79 * GIB * (1 + ARRIVAL_TOLERANCE)) - 4 * GIB
    assert (
        check_arrival(
            profile(memory_model=MemoryModel(fixed_bytes=4 * GIB, bytes_per_sample=edge // 64))
        )
        == ()
    )


def test_a_maximum_its_own_line_puts_past_the_memory_is_refused_naming_both_fields() -> None:
    # The issue's: max 5000 at 1 GiB a sample on an 80 GB card, a peak of 5000 GiB.
    impossible = profile(
        max_micro_batch_size=5000,
        recommended_micro_batch_size=2500,
        memory_model=MemoryModel(fixed_bytes=GIB, bytes_per_sample=GIB),
    )

    found = check_arrival(impossible)

    assert fields(found) == ["max_micro_batch_size", "memory_model"]
    assert "max_micro_batch_size 5000" in found[0].reason
    assert "peak at 4.88 TiB, past capacity_bytes" in found[0].reason


def test_a_trial_that_fitted_more_than_its_card_is_refused() -> None:
    found = check_arrival(
        profile(trials=(Trial(micro_batch_size=64, fits=True, peak_allocated_bytes=2**50),))
    )
    assert fields(found) == ["trials"]
    assert "micro_batch_size 64" in found[0].reason


@pytest.mark.parametrize(
    ("name", "total", "expected"),
    [
        (H100, 80 * GIB, []),  # 80 GiB, a rounding of NVML's 81,559 MiB: within the tolerance
        (H100, 2**50, ["total_memory_bytes"]),  # 1 PiB on an 80 GB card
        ("NVIDIA-H100-80GB-HBM3", 81559 << 20, []),  # any name form
        (f"{H100} MIG 1g.10gb", 10 * GIB, []),  # a slice: within its whole card's memory
        (f"{H100} MIG 1g.10gb", 2**50, ["total_memory_bytes"]),
        ("NVIDIA B999", 2**50, ["device_name"]),  # nobody can check it, NVML did not say it
    ],
)
def test_the_cards_memory_is_checked_against_the_catalogue(
    name: str, total: int, expected: list[str]
) -> None:
    on_card = profile(
        device_name=name,
        total_memory_bytes=total,
        capacity_bytes=min(total, 79 * GIB),
        memory_model=None,  # the card alone: its line and trials are the tests above
        trials=(),
    )
    found = check_arrival(on_card)
    assert fields(found) == expected


def test_an_uncatalogued_card_is_taken_as_nvml_reported_it_and_marked() -> None:
    reading = BudgetReading(
        source="nvml", total_bytes=96 * GIB, available_bytes=95 * GIB, free_bytes=95 * GIB
    )
    new_card = profile(
        device_name="NVIDIA RTX PRO 6000",
        total_memory_bytes=96 * GIB,
        capacity_bytes=95 * GIB,
        budget=combine_budget([reading]),
    )

    assert check_arrival(new_card) == ()
    note = uncatalogued_note(new_card)
    assert note is not None and "'NVIDIA RTX PRO 6000'" in note and "unchecked" in note
    assert uncatalogued_note(profile()) is None
    # Another total than NVML's reading is not what NVML reported.
    lied = profile(
        device_name="NVIDIA RTX PRO 6000",
        total_memory_bytes=2**50,
        capacity_bytes=95 * GIB,
        budget=combine_budget([reading]),
    )
    assert fields(check_arrival(lied)) == ["device_name"]


def test_simulated_devices_have_no_card_but_their_arithmetic_is_checked() -> None:
    sim = {"device_name": "sim", "device_type": "sim", "total_memory_bytes": 2 * GIB}
    assert check_arrival(profile(**sim, capacity_bytes=2 * GIB, memory_model=None, trials=())) == ()
    assert uncatalogued_note(profile(**sim, capacity_bytes=2 * GIB)) is None
    found = check_arrival(profile(**sim, capacity_bytes=GIB // 2))
    assert fields(found) == ["max_micro_batch_size", "memory_model", "trials"]


def test_the_catalogue_holds_real_cards_in_any_name_form_and_nothing_else() -> None:
    assert catalogue_memory_bytes("NVIDIA-L40S") == 48 * GIB
    assert catalogue_memory_bytes("NVIDIA A100-SXM4-80GB") == 80 * GIB
    assert catalogue_memory_bytes("NVIDIA B999") is None
    assert catalogue_memory_bytes("") is None
    assert catalogue_memory_bytes(f"{H100} MIG 1g.10gb") is None


@pytest.mark.parametrize("device_type", ["cpu", "simulated", "mps"])
def test_a_catalogued_name_is_checked_whatever_the_device_type(device_type: str) -> None:
    petabyte = profile(
        device_type=device_type,
        total_memory_bytes=2**50,
        capacity_bytes=2**50,
        trials=(Trial(micro_batch_size=64, fits=True, peak_allocated_bytes=36 * GIB),),
    )
    assert fields(check_arrival(petabyte)) == ["total_memory_bytes"]
    assert check_arrival(profile(device_type=device_type)) == ()


@pytest.mark.parametrize(
    ("name", "total", "refused"),
    [
        (f"{H100} MIG 1g.10gb", 80 * GIB, True),  # the whole card's memory on a 10 GB slice
        (f"{H100} MIG 1g.10gb", 9856 << 20, False),  # what NVML reports for it
        (f"{H100} MIG 3g.40gb", 40192 << 20, False),
        (f"{H100} MIG 3g.40gb", 60 * GIB, True),
        (f"{H100} MIG 7g.80gb", 81559 << 20, False),
    ],
)
def test_a_mig_slice_is_checked_against_its_slice_s_size(
    name: str, total: int, refused: bool
) -> None:
    slice_ = profile(
        device_name=name,
        total_memory_bytes=total,
        capacity_bytes=total * 9 // 10,
        max_micro_batch_size=2,
        recommended_micro_batch_size=2,
        trials=(Trial(micro_batch_size=2, fits=True, peak_allocated_bytes=5 * GIB),),
    )
    assert ("total_memory_bytes" in fields(check_arrival(slice_))) is refused
