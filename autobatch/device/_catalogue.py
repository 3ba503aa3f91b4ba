"""PURE: the cards autobatch knows, by card key, with the memory NVML reports for each.

A fleet's central service checks what a node says against this table (a profile's
``total_memory_bytes`` within its card's memory) and predicts one card from another's profile
only through it: a name nobody can check (a fictitious ``"NVIDIA B999"``) never speaks for a
real card, and a real card's memory is the catalogue's, not what some profile claims.

The numbers are the most memory NVML (``nvmlDeviceGetMemoryInfo``, as ``nvidia-smi`` shows it)
reports for each product, in MiB: an HBM card's total (81,559 MiB on an H100 SXM, whose 80 GiB
lose 361 MiB to the driver's reserve), a GDDR card's with ECC off (its data sheet's size:
ECC on takes about 6% more, so an L4 then shows 23,034 of its 24,576 MiB). Each is an upper
bound of what a real card of that name reports; the driver moves it by a few hundred MiB
between versions, which :data:`CARD_MEMORY_TOLERANCE` covers. A whole card's name only: a MIG
slice has no entry of its own.

Example::

    catalogue_memory_bytes("NVIDIA-H100-80GB-HBM3")   # 85520809984 (81559 MiB)
    catalogue_memory_bytes("NVIDIA B999")             # None: not a card autobatch knows
"""

from __future__ import annotations

from autobatch.device._card_names import card_key
from autobatch.errors import ConfigError

__all__ = ["CARD_MEMORY_TOLERANCE", "CATALOGUE_MIB", "catalogue_memory_bytes"]

CARD_MEMORY_TOLERANCE = 0.05
"""How far above the catalogue's memory a card's reported total may be (5%): driver versions
move NVML's total by a few hundred MiB (its reserve), and a profile written by hand or by an
older autobatch may round 81,559 MiB up to 80 GiB (0.4%). A 1 PiB "80 GB" card is far past it."""

CATALOGUE_MIB: dict[str, int] = {
    # Hopper and Blackwell
    "h100-80gb-hbm3": 81559,
    "h100-pcie": 81559,
    "h100-nvl": 95830,
    "h200": 143771,
    "gh200-480gb": 97871,
    "b200": 183359,
    # Ampere
    "a100-sxm4-80gb": 81920,
    "a100-sxm4-40gb": 40960,
    "a100-80gb-pcie": 81920,
    "a100-pcie-40gb": 40960,
    "a10": 24576,
    "a10g": 24576,
    "a40": 49152,
    # Ada
    "l4": 24576,
    "l40": 49152,
    "l40s": 49152,
    "geforce-rtx-4090": 24576,
    # Turing and Volta
    "tesla-t4": 16384,
    "tesla-v100-sxm2-16gb": 16384,
    "tesla-v100-sxm2-32gb": 32768,
}
"""Card key (:func:`autobatch.device.card_key`) -> the most memory NVML reports for it, MiB."""


def catalogue_memory_bytes(name: str) -> int | None:
    """The memory of the card ``name`` names (any form :func:`card_key` reads), in bytes;
    None for a name the catalogue does not hold (or one that names no card, or a MIG slice)."""
    try:
        key = card_key(name)
    except ConfigError:
        return None
    mib = CATALOGUE_MIB.get(key)
    return None if mib is None else mib << 20
