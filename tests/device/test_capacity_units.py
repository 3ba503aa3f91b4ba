"""A device's memory given without a unit: under 1 MiB it is a unit left off (``sim:3`` meant
3 GiB), refused with the size it likely meant, on every surface that names a device or a
capacity (Python's device strings, the CLI's --device and --capacity, the service's probes)."""

from __future__ import annotations

import pytest

from autobatch.cli import main
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
    assert capsys.readouterr().err == f"autobatch: error: {SIM_3}\n"
    with pytest.raises(SystemExit) as exited:
        main(["estimate", "gpt2-tiny", "--capacity", "80"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "autobatch estimate: error: argument --capacity: memory size '80' is 80 bytes (a number "
        "without a unit is bytes), too little for a device (under 1.00 MiB); did you mean "
        "'80GiB'?"
    )
