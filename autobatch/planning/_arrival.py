"""PURE: whether a profile another process sends adds up, against itself and its card.

A fleet's central service stores what nodes publish and plans other jobs from it, so a profile
is checked on arrival (:func:`check_arrival`), each check naming the profile's fields:

- its memory line at its own maximum: ``fixed_bytes + bytes_per_sample * max_micro_batch_size``
  within ``capacity_bytes`` (with :data:`ARRIVAL_TOLERANCE`): a maximum that the profile's own
  line puts past its memory never ran;
- each trial that fitted: its peak within the card's ``total_memory_bytes`` (the same
  tolerance): no step holds more than the card has;
- a catalogued card's ``total_memory_bytes`` within the catalogue's memory for its name
  (:func:`autobatch.device.catalogue_memory_bytes`, with its own tolerance), whatever
  ``device_type`` says: a ``"cpu"`` profile under an H100's name is checked as an H100; a MIG
  slice within its slice's size where its name gives it (``1g.10gb``: 10 GiB), else its whole
  card's; a CUDA card's name the catalogue does not hold is taken only as NVML reported it (the
  profile's budget holds an ``nvml`` reading of that total), and marked as such
  (:func:`uncatalogued_note`).

Simulated and CPU devices under a name no catalogue holds have no card to check; their
arithmetic is checked all the same.
Imports neither torch nor pynvml.

Example::

    for found in check_arrival(profile):
        print(found.field, found.reason)    # "memory_model", "the line puts ..."
"""

from __future__ import annotations

import dataclasses
import re

from autobatch.device import CARD_MEMORY_TOLERANCE, card_key, catalogue_memory_bytes
from autobatch.errors import ConfigError
from autobatch.profile import Profile
from autobatch.units import format_bytes

__all__ = ["ARRIVAL_TOLERANCE", "Discrepancy", "check_arrival", "uncatalogued_note"]

ARRIVAL_TOLERANCE = 0.10
"""How far past its memory a profile's own numbers may reach before they cannot be true (10%):
its line is a secant through measured peaks, rounded up to whole bytes per sample, so at the
maximum it may overshoot the peak that really ran by the allocator's rounding (up to 2 MiB a
block) and a few bytes per sample; a CUDA peak counts what the caching allocator reserved,
which a card's reserve and context move by a few percent. Ten percent is twice the widest of
these; a profile claiming 1 GiB a sample at 5,000 on an 80 GB card is 60 times past it."""

_UNCATALOGUED = "card not in autobatch's catalogue: "

_MIG_SIZE = re.compile(r"\d+g\.(\d+)gb")
"""A MIG profile's memory in its name (``1g.10gb``: 10), in GiB: NVML reports a slice at or
below it (an H100's 1g.10gb: 9,856 MiB; its 7g.80gb: 81,559 MiB)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Discrepancy:
    """One thing a profile says that does not add up."""

    field: str
    """The profile's field at fault (its keyword, e.g. ``"memory_model"``)."""
    reason: str
    """Why, with the numbers, and what to send instead."""


def check_arrival(profile: Profile) -> tuple[Discrepancy, ...]:
    """What in ``profile`` does not add up (module docstring); empty when all does."""
    found = [*_line_at_max(profile), *_trial_peaks(profile), *_card_memory(profile)]
    return tuple(found)


def uncatalogued_note(profile: Profile) -> str | None:
    """The note that marks a profile of a CUDA card the catalogue does not hold, whose name and
    memory NVML reported (None for a catalogued card, or not CUDA)."""
    if profile.device_type != "cuda" or _catalogue_bytes(profile.device_name) is not None:
        return None
    return (
        f"{_UNCATALOGUED}{profile.device_name!r} with "
        f"{format_bytes(profile.total_memory_bytes)} is as NVML reported it on node "
        f"{profile.node_name or 'unrecorded'}, unchecked; it never speaks for another card"
    )


def _line_at_max(profile: Profile) -> list[Discrepancy]:
    line = profile.memory_model
    if line is None or profile.capacity_bytes <= 0:
        return []
    peak = line.peak_bytes(profile.max_micro_batch_size)
    if peak <= profile.capacity_bytes * (1 + ARRIVAL_TOLERANCE):
        return []
    reason = (
        f"memory_model (fixed_bytes {line.fixed_bytes} + bytes_per_sample "
        f"{line.bytes_per_sample} x max_micro_batch_size {profile.max_micro_batch_size}) puts "
        f"the maximum's peak at {format_bytes(peak)}, past capacity_bytes "
        f"{profile.capacity_bytes} ({format_bytes(profile.capacity_bytes)}) by more than "
        f"{ARRIVAL_TOLERANCE:.0%}: a size that needs more than the memory never ran; send the "
        "profile as measured"
    )
    return [
        Discrepancy(field="max_micro_batch_size", reason=reason),
        Discrepancy(field="memory_model", reason=reason),
    ]


def _trial_peaks(profile: Profile) -> list[Discrepancy]:
    bound = profile.total_memory_bytes * (1 + ARRIVAL_TOLERANCE)
    over = [
        trial
        for trial in profile.trials
        if trial.fits and max(trial.peak_allocated_bytes, trial.peak_reserved_bytes) > bound
    ]
    if not over:
        return []
    first = over[0]
    peak = max(first.peak_allocated_bytes, first.peak_reserved_bytes)
    return [
        Discrepancy(
            field="trials",
            reason=(
                f"the trial at micro_batch_size {first.micro_batch_size} fitted with a peak of "
                f"{format_bytes(peak)}, past total_memory_bytes {profile.total_memory_bytes} "
                f"({format_bytes(profile.total_memory_bytes)}) by more than "
                f"{ARRIVAL_TOLERANCE:.0%} ({len(over)} such trial(s)): no step holds more than "
                "its card; send the trials as measured"
            ),
        )
    ]


def _card_memory(profile: Profile) -> list[Discrepancy]:
    known = _catalogue_bytes(profile.device_name)
    total = profile.total_memory_bytes
    if known is None and profile.device_type != "cuda":
        return []  # a host, a simulated or MPS device under a name no catalogue holds
    if known is not None:
        if total <= known * (1 + CARD_MEMORY_TOLERANCE):
            return []
        return [
            Discrepancy(
                field="total_memory_bytes",
                reason=(
                    f"total_memory_bytes {total} ({format_bytes(total)}) is more than "
                    f"{profile.device_name!r} has ({format_bytes(known)} in autobatch's "
                    f"catalogue, {CARD_MEMORY_TOLERANCE:.0%} tolerance; device_type "
                    f"{profile.device_type!r}): send the memory NVML reports for the card, "
                    "or a device_name that names the device measured"
                ),
            )
        ]
    if _nvml_reported(profile):
        return []
    return [
        Discrepancy(
            field="device_name",
            reason=(
                f"device_name {profile.device_name!r} is not a card in autobatch's catalogue, "
                f"and budget holds no 'nvml' reading of total_memory_bytes {total}: publish "
                "the profile as autobatch measured it on the card (its budget records NVML's "
                "reading), or name the card as NVML does (e.g. 'NVIDIA H100 80GB HBM3')"
            ),
        )
    ]


def _catalogue_bytes(name: str) -> int | None:
    """The catalogue's memory for ``name``, in bytes; for a MIG slice's name, its slice's size
    where the MIG profile gives it (``1g.10gb``: 10 GiB, at most the whole card's), else its
    whole card's (an upper bound of the slice's). None for a card the catalogue does not hold."""
    try:
        key = card_key(name)
    except ConfigError:
        return None
    whole_key, _, mig = key.partition("-mig-")
    whole = catalogue_memory_bytes(whole_key)
    sized = _MIG_SIZE.match(mig)
    if whole is None or sized is None:
        return whole
    return min(whole, int(sized.group(1)) << 30)


def _nvml_reported(profile: Profile) -> bool:
    budget = profile.budget
    if budget is None:
        return False
    return any(
        reading.source == "nvml" and reading.total_bytes == profile.total_memory_bytes
        for reading in budget.readings
    )
