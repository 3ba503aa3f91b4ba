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

from autobatch.errors import ConfigError

__all__ = ["format_bytes", "parse_bytes"]

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


def parse_bytes(value: str | int) -> int:
    """Parse a byte quantity.

    Args:
        value: an ``int`` of bytes, or a string such as ``"16GiB"``, ``"512 MiB"``, ``"80GB"``,
            ``"1024"``. Binary (KiB, MiB, GiB, TiB; also K, M, G, T) and decimal (KB, MB, GB, TB)
            units, case-insensitive.

    Returns:
        The quantity in bytes (rounded down to a whole byte), always > 0.

    Raises:
        ConfigError: the value is not a positive quantity with a known unit.
    """
    if isinstance(value, bool):
        raise ConfigError(f"memory size {value!r} is a bool; give bytes as an int or e.g. '16GiB'")
    if isinstance(value, int):
        number = value
    else:
        match = _PATTERN.match(str(value))
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
