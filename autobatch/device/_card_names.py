"""One card, whatever its name's form: the key that every lookup of a card type compares.

PURE: names in, keys out; no torch, no pynvml. A card type reaches autobatch under several
spellings of the same product:

- NVML's name, as a probe records it (a profile's ``device_name``): ``"NVIDIA H100 80GB HBM3"``,
  and for a MIG instance ``"NVIDIA H100 80GB HBM3 MIG 1g.10gb"``;
- GPU feature discovery's ``nvidia.com/gpu.product`` label, spaces written as dashes:
  ``"NVIDIA-H100-80GB-HBM3"``, ``"NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"``, and ``-SHARED``
  appended when the device plugin shares the card (time-slicing or MPS: the same card, a
  smaller budget, which the memory budget says, not the name);
- a catalogue's name without the vendor: ``"H100 80GB HBM3"``, ``"H100-80GB-HBM3"``;
- a whole card's name with the MIG profile given apart (``mig_profile="1g.10gb"``).

:func:`card_key` maps each to one key: the name's words (split at spaces, dashes and
underscores) in lower case joined by dashes, without a leading ``nvidia`` and a trailing
``shared``, and ``mig-<profile>`` last for a MIG slice. Nothing else is folded: ``"H100 PCIe"``
and ``"H100 80GB HBM3"`` are different cards, and so are a card and a MIG slice of it.

Example::

    card_key("NVIDIA-H100-80GB-HBM3") == card_key("NVIDIA H100 80GB HBM3")   # True
    card_key("NVIDIA H100 80GB HBM3", mig_profile="1g.10gb")  # 'h100-80gb-hbm3-mig-1g.10gb'
"""

from __future__ import annotations

import functools
import re

from autobatch.errors import ConfigError

__all__ = ["card_key", "same_card"]

_WORD_BREAKS = re.compile(r"[\s_-]+")
_VENDOR = "nvidia"
_SHARED = "shared"
_MIG = "mig"


@functools.lru_cache(maxsize=4096)
def card_key(name: str, mig_profile: str | None = None) -> str:
    """The canonical key of a card type (module docstring); remembered for the last 4096
    names (a plan by card compares every candidate's name, on every request).

    Args:
        name: the card's name in any of its usual forms (NVML's, a GFD label's, a catalogue's),
            a MIG slice's included.
        mig_profile: the MIG profile of the slice (e.g. ``"1g.10gb"``) when ``name`` names the
            whole card; None (or ``""``) for a whole card, or when ``name`` carries it.

    Returns:
        E.g. ``"h100-80gb-hbm3"``, ``"h100-80gb-hbm3-mig-1g.10gb"``.

    Raises:
        ConfigError: ``name`` is empty (or only the vendor), or it names a MIG profile other
            than ``mig_profile``.
    """
    words = [word for word in _WORD_BREAKS.split(name.strip().lower()) if word]
    if words and words[0] == _VENDOR:
        words = words[1:]
    if words and words[-1] == _SHARED:
        words = words[:-1]
    slice_words: list[str] = []
    if _MIG in words:
        at = words.index(_MIG)
        words, slice_words = words[:at], words[at + 1 :]
    if not words:
        raise ConfigError(
            f"card name {name!r} names no card: give the product, e.g. 'NVIDIA H100 80GB HBM3' "
            "(NVML's name) or 'NVIDIA-H100-80GB-HBM3' (the nvidia.com/gpu.product label)"
        )
    named = "-".join(slice_words)
    wanted = "-".join(w for w in _WORD_BREAKS.split((mig_profile or "").strip().lower()) if w)
    if named and wanted and named != wanted:
        raise ConfigError(
            f"card name {name!r} names MIG profile {named!r}, but mig_profile is {mig_profile!r}: "
            "give the whole card's name with mig_profile, or the slice's name alone"
        )
    profile = named or wanted
    return "-".join([*words, _MIG, profile] if profile else words)


def same_card(first: str, second: str) -> bool:
    """Whether two names (any forms, MIG slices included) name the same card type; a name that
    names no card (empty) is no card's."""
    try:
        return card_key(first) == card_key(second)
    except ConfigError:
        return False
