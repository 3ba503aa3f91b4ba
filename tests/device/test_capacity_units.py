"""A device's memory given without a unit: under 1 MiB it is a unit left off (``sim:3`` meant
3 GiB), refused with the size it likely meant, on every surface that names a device or a
capacity (Python's device strings, the CLI's --device and --capacity, the service's probes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autobatch.cli import main
from autobatch.cli._output import flag_wording
from autobatch.device import resolve_device
from autobatch.device._resolve import ParsedDevice, parse_device
from autobatch.errors import ConfigError
from autobatch.units import MIN_UNITLESS_CAPACITY_BYTES, parse_capacity

SIM_3 = (
    "memory size 'sim:3' is 3 bytes (a number without a unit is bytes), too little for a "
    "device (under 1.00 MiB); did you mean 'sim:3GiB'?"
)


@pytest.mark.parametrize(
    ("text", "meant"),
    [("3", "3GiB"), (" 80 ", "80GiB"), ("1023", "1023GiB"), ("4096", "4096MiB")],
)
def test_a_bare_number_under_a_mebibyte_names_the_unit_it_lacks(text: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{meant}'\\?$"):
        parse_capacity(text)


@pytest.mark.parametrize(
    ("value", "num_bytes"),
    [
        (str(MIN_UNITLESS_CAPACITY_BYTES), 2**20),  # bytes, spelled out: a device's least
        ("3GiB", 3 * 2**30),
        ("512 KiB", 512 * 2**10),  # a unit given: small on purpose
        ("100B", 100),
        (3, 3),  # an int is bytes on purpose
    ],
)
def test_a_unit_or_a_plausible_number_is_taken_as_written(value: str | int, num_bytes: int) -> None:
    assert parse_capacity(value) == num_bytes


def test_python_device_strings_refuse_a_missing_unit() -> None:
    with pytest.raises(ConfigError) as raised:
        resolve_device("sim:3")
    assert str(raised.value) == SIM_3
    assert parse_device("sim:1048576") == ParsedDevice(type="sim", capacity_bytes=2**20)


def test_the_cli_device_and_capacity_name_the_missing_unit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["tune", "tests.service.models:tiny_mlp", "--input-shape", "32", "--no-store"]
    assert main([*argv, "--device", "sim:3", "--effective-batch-size", "8"]) == 1
    hint = "try 'autobatch tune --help'"
    assert capsys.readouterr().err == f"autobatch tune: error: {SIM_3}\n{hint}\n"
    with pytest.raises(SystemExit) as exited:
        main(["estimate", "gpt2-tiny", "--capacity", "80"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "autobatch estimate: error: argument --capacity: memory size '80' is 80 bytes (a number "
        "without a unit is bytes), too little for a device (under 1.00 MiB); did you mean "
        "'80GiB'?"
    )


SIM_32_GB = (
    "memory size 'sim:32Gb' could mean bits or bytes (a lower-case b is a bit); write "
    "'sim:32GiB' (binary, 2**30 bytes per GiB) or 'sim:32GB' (decimal, 10**9 bytes per GB)"
)


def test_a_unit_that_could_mean_bits_is_refused_on_every_surface(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve_device("sim:32Gb")
    assert str(raised.value) == SIM_32_GB
    argv = ["tune", "tests.service.models:tiny_mlp", "--input-shape", "32", "--no-store"]
    assert main([*argv, "--device", "sim:32Gb", "--effective-batch-size", "8"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == f"autobatch tune: error: {SIM_32_GB}"
    with pytest.raises(SystemExit) as exited:
        main(
            ["plan", "--max-micro-batch-size", "8", "--effective-batch-size", "8"]
            + ["--capacity", "32Gb"]
        )
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "autobatch plan: error: argument --capacity: memory size '32Gb' could mean bits or bytes "
        "(a lower-case b is a bit); write '32GiB' (binary, 2**30 bytes per GiB) or '32GB' "
        "(decimal, 10**9 bytes per GB)"
    )


CAPACITY_80 = (
    "a capacity of 80 bytes is too little for a device (under 1.00 MiB): capacities are in bytes; "
    "use {}"
)


def test_a_plans_capacity_in_bytes_under_a_mebibyte_names_the_unit_it_lacks() -> None:
    from autobatch import plan
    from autobatch.profile import MemoryModel

    model = MemoryModel(fixed_bytes=2**30, bytes_per_sample=2**20)
    with pytest.raises(ConfigError) as raised:
        plan(model, effective_batch_size=64, capacity_bytes=80)
    assert str(raised.value) == CAPACITY_80.format(
        "capacity_bytes=85899345920 (80 GiB, if the unit was left off)"
    )
    with pytest.raises(ConfigError, match=r"^a capacity of 4096 bytes .*; use capacity_bytes="
                       r"4294967296 \(4096 MiB, if the unit was left off\)$"):  # fmt: skip
        plan(model, effective_batch_size=64, capacity_bytes=4096)
    assert plan(model, effective_batch_size=64, capacity_bytes=80 * 2**30).micro_batch_size == 64
    # The command line words the remedy as its flag, with the unit (as the CLI prints errors).
    assert raised.value.describe(flag_wording) == CAPACITY_80.format(
        "--capacity 80GiB (80 GiB, if the unit was left off)"
    )


def test_the_service_refuses_a_capacity_in_bytes_under_a_mebibyte(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.web.settings import Settings
    from tests.service.conftest import fake_gpus

    app = create_app(Settings(store_path=str(tmp_path / "store.sqlite3")), nvml=fake_gpus())
    try:
        answer = TestClient(app).post(
            "/v1/plan",
            json={
                "memory_model": {"fixed_bytes": 2**30, "bytes_per_sample": 2**20},
                "effective_batch_size": 64,
                "device": {"capacity_bytes": 80},
            },
        )
    finally:
        app.state.service.runs.close()
        app.state.service.store.close()
    assert answer.status_code == 422, answer.text
    detail = CAPACITY_80.format(
        '"device": {"capacity_bytes": 85899345920} (80 GiB, if the unit was left off)'
    )
    assert answer.json()["detail"] == detail
