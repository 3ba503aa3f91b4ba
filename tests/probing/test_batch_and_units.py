"""Micro-batches from a sample, and byte quantities."""

from __future__ import annotations

import pytest
import torch

from autobatch.errors import ConfigError
from autobatch.probing._batch import BatchSource
from autobatch.units import format_bytes, parse_bytes


def test_tiles_rows_cyclically_for_every_tensor() -> None:
    sample = {"ids": torch.tensor([[1, 2], [3, 4]]), "mask": torch.tensor([[1, 1], [1, 0]]), "n": 7}
    source = BatchSource.from_sample(sample)
    batch = source.make(5)
    assert batch["ids"].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4], [1, 2]]
    assert batch["mask"][:, 1].tolist() == [1, 0, 1, 0, 1]
    assert batch["n"] == 7
    assert source.sample_shapes == {"ids": (2,), "mask": (2,)}


def test_callable_must_return_n_rows() -> None:
    source = BatchSource.from_sample(lambda n: torch.zeros(n, 3))
    assert source.make(4).shape == (4, 3)
    with pytest.raises(ConfigError, match="sample\\(1\\) returned a batch of 2 rows"):
        BatchSource.from_sample(lambda n: torch.zeros(n + 1, 3))
    with pytest.raises(ConfigError, match="must be >= 1"):
        source.make(0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("1.5g", 1610612736),
        (1024, 1024),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "0", "1 parsec", True])
def test_parse_bytes_rejects(text: object) -> None:
    with pytest.raises(ConfigError, match="memory size"):
        parse_bytes(text)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(80 * 2**30) == "80.00 GiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"


BINARY_OR_DECIMAL = (
    "'{0}{1}iB' (binary, 2**{2} bytes per {1}iB) or '{0}{1}B' (decimal, 10**{3} bytes per {1}B)"
)


@pytest.mark.parametrize(
    ("text", "spellings"),
    [
        ("32Gb", BINARY_OR_DECIMAL.format("32", "G", 30, 9)),
        ("32gb", BINARY_OR_DECIMAL.format("32", "G", 30, 9)),
        ("512 Mb", BINARY_OR_DECIMAL.format("512 ", "M", 20, 6)),
        ("4kb", BINARY_OR_DECIMAL.format("4", "K", 10, 3)),
        ("2Tb", BINARY_OR_DECIMAL.format("2", "T", 40, 12)),
        ("1.5gib", "'1.5GiB' (2**30 bytes per GiB)"),
    ],
)
def test_a_unit_that_could_mean_bits_is_refused_with_the_spellings_it_may_mean(
    text: str, spellings: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_bytes(text)
    assert str(refused.value) == (
        f"memory size {text!r} could mean bits or bytes (a lower-case b is a bit); write "
        f"{spellings}"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32GB", 32 * 10**9), ("32GiB", 32 * 2**30), ("32gB", 32 * 10**9), ("32g", 32 * 2**30)],
)
def test_an_upper_case_b_is_bytes_whatever_the_prefixs_case(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected
