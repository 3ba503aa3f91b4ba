"""Byte quantities: parse ``"16GiB"`` on input, format for display. Code keeps ``int`` bytes.

Example::

    >>> parse_bytes("1.5GiB")
    1610612736
    >>> format_bytes(1610612736)
    '1.50 GiB'
"""

from __future__ import annotations

import math
import re

from autobatch.errors import ConfigError, Remedy

__all__ = [
    "MIN_UNITLESS_CAPACITY_BYTES",
    "check_capacity_bytes",
    "counted",
    "format_bytes",
    "parse_bytes",
    "parse_capacity",
]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_BITS_OR_BYTES = re.compile(r"^[KkMmGgTt]i?b$")
"""A prefix then a lower-case ``b`` (``Gb``, ``mb``, ``Gib``): bits to some (gigabits, as network
links are sold), bytes to others, and never certainly which."""


def parse_bytes(value: str | int) -> int:
    """Parse a byte quantity.

    Args:
        value: an ``int`` of bytes, or a string such as ``"16GiB"``, ``"512 MiB"``, ``"80GB"``,
            ``"1024"``. Binary (KiB, MiB, GiB, TiB; also K, M, G, T) and decimal (KB, MB, GB, TB)
            units, the prefix in either case; the ``B`` of bytes is upper-case after a prefix
            (``Gb`` could mean gigabits).

    Returns:
        The quantity in bytes (rounded down to a whole byte), always > 0.

    Raises:
        ConfigError: the value is not a positive quantity with a known unit, or its unit could
            mean bits or bytes (``"32Gb"``: the message names ``'32GiB'`` and ``'32GB'``).
    """
    return _parse_bytes(value, prefix="")


def _parse_bytes(value: str | int, *, prefix: str) -> int:
    """:func:`parse_bytes`, naming the value as written after ``prefix`` (``"sim:"``)."""
    if isinstance(value, bool):
        raise ConfigError(f"memory size {value!r} is a bool; give bytes as an int or e.g. '16GiB'")
    if isinstance(value, int):
        number = value
    else:
        match = _PATTERN.match(str(value))
        if match is not None and _BITS_OR_BYTES.match(match.group(2)):
            _refuse_bits_or_bytes(prefix + str(value).strip(), match.group(2))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"memory size {value!r} is not understood; write e.g. '16GiB', '512MiB' or a "
                "number of bytes"
            )
        if unit in ("", "B") and "." in match.group(1):
            raise ConfigError(
                f"memory size {value!r} is a fraction of a byte; give a unit, e.g. '1.5GiB'"
            )
        scaled = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(scaled) or scaled >= 2**63:
            raise ConfigError(f"memory size {str(value)[:40]!r}... is too large (over 8 EiB)")
        number = int(scaled)
    if number <= 0:
        raise ConfigError(f"memory size {value!r} must be more than 0 bytes")
    return number


def _refuse_bits_or_bytes(written: str, unit: str) -> None:
    """Refuse ``written`` (e.g. ``"sim:32Gb"``), whose ``unit`` ends in a lower-case ``b``.

    Raises:
        ConfigError: always, naming the value and the spellings it may have meant.
    """
    stem = written[: len(written) - len(unit)]
    letter = unit[0].upper()
    power = "KMGT".index(letter) + 1
    meant = f"{stem}{letter}iB"
    if "i" in unit:
        spellings = f"{meant!r} (2**{10 * power} bytes per {letter}iB)"
    else:
        spellings = (
            f"{meant!r} (binary, 2**{10 * power} bytes per {letter}iB) or "
            f"'{stem}{letter}B' (decimal, 10**{3 * power} bytes per {letter}B)"
        )
    raise ConfigError(
        f"memory size {written!r} could mean bits or bytes (a lower-case b is a bit); write "
        f"{spellings}"
    )


MIN_UNITLESS_CAPACITY_BYTES = 1 << 20
"""The least a device's memory given as a bare number (bytes, no unit) may be: 1 MiB. Less is
taken for a missing unit (``sim:3`` meant ``sim:3GiB``), not a device."""


def parse_capacity(value: str | int, *, prefix: str = "") -> int:
    """Parse a device's memory: :func:`parse_bytes`, refusing a bare number under 1 MiB.

    The one parser of device and capacity sizes (``sim:SIZE``, the CLI's ``--capacity``). A
    number without a unit is bytes; one under :data:`MIN_UNITLESS_CAPACITY_BYTES` is no
    device's memory but a unit left off, so it is refused with the size it likely meant.
    An ``int`` is bytes on purpose and is taken as it is.

    Args:
        value: e.g. ``"2GiB"``, ``"16 MiB"``, ``"1073741824"``, or an ``int`` of bytes.
        prefix: what precedes the size where it was written (``"sim:"``), for the message.

    Returns:
        The capacity in bytes, > 0.

    Raises:
        ConfigError: as :func:`parse_bytes` (a unit that could mean bits named with the
            ``prefix``: ``'sim:32Gb'``), or a bare number under 1 MiB, e.g. ``"3"``: "'sim:3' is
            3 bytes ...; did you mean 'sim:3GiB'?".
    """
    num_bytes = _parse_bytes(value, prefix=prefix)
    if isinstance(value, int) or num_bytes >= MIN_UNITLESS_CAPACITY_BYTES:
        return num_bytes
    match = _PATTERN.match(value)
    if match is None or match.group(2):
        return num_bytes  # a unit was given: a small size meant as written
    written = prefix + value.strip()
    meant = written + ("GiB" if num_bytes < 1024 else "MiB")
    raise ConfigError(
        f"memory size {written!r} is {num_bytes} bytes (a number without a unit is bytes), "
        f"too little for a device (under {format_bytes(MIN_UNITLESS_CAPACITY_BYTES)}); did you "
        f"mean {meant!r}?"
    )


class _Bytes(int):
    """Bytes a remedy names: Python and JSON show the int (``repr``), the command line the size
    with its unit (``str``: ``80GiB``), as each takes it."""

    written: str
    """The size with its unit, e.g. ``"80GiB"``."""

    def __new__(cls, num_bytes: int, written: str) -> _Bytes:
        made = super().__new__(cls, num_bytes)
        made.written = written
        return made

    def __str__(self) -> str:
        return self.written

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self) -> tuple[object, ...]:
        return _Bytes, (int(self), self.written)


def check_capacity_bytes(value: int) -> int:
    """Check a device's memory given as an int of bytes, as a plan's ``capacity_bytes`` is (from
    Python, or a service's ``device.capacity_bytes``): an int >= 1 MiB, since less is no
    device's memory but a unit left off (``capacity_bytes: 80`` meant 80 GiB).

    Args:
        value: the bytes.

    Returns:
        ``value``.

    Raises:
        ConfigError: not an int >= 1, or under :data:`MIN_UNITLESS_CAPACITY_BYTES`; the message
            names the value, and its remedy the size it likely meant (``capacity_bytes``: the
            int in Python and JSON, ``--capacity 80GiB`` on the command line).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"capacity_bytes {value!r} must be an int >= 1 (bytes)")
    if value >= MIN_UNITLESS_CAPACITY_BYTES:
        return value
    unit, scale = ("GiB", 2**30) if value < 1024 else ("MiB", 2**20)
    raise ConfigError(
        f"a capacity of {value} bytes is too little for a device (under "
        f"{format_bytes(MIN_UNITLESS_CAPACITY_BYTES)}): capacities are in bytes",
        remedies=[
            Remedy(
                parameter="capacity_bytes",
                values=(_Bytes(value * scale, f"{value}{unit}"),),
                purpose=f"{value} {unit}, if the unit was left off",
            )
        ],
    )


def format_bytes(num_bytes: int) -> str:
    """Format bytes for display with binary units (``'1.50 GiB'``). Display only."""
    sign = "-" if num_bytes < 0 else ""
    size = float(abs(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    if unit == "B":
        return f"{sign}{int(size)} B"
    if size >= 1024:
        return f"{sign}{size / 1024:.2f} TiB"
    return f"{sign}{size:.2f} {unit}"


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, the noun plural (an ``s`` added) unless the count is 1:
    ``counted(1, "GPU")`` is ``"1 GPU"``, ``counted(8, "GPU")`` ``"8 GPUs"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
