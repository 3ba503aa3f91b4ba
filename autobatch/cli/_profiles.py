"""``autobatch profiles list|show``: stored profiles, as a table or one profile in words (JSON
with ``--json``).

The listing names each card with its memory (``sim (4.00 MiB)``) and says which size is which:
``MEASURED MAX`` is the largest micro-batch that ran in the profile's trials, ``RECOMMENDED``
that less the safety margin (what a plan from it plans within).

Example::

    print_profile_table(store.list_profiles(), sys.stdout)
    print_profile(profile_id, profile, sys.stdout)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from autobatch.cli._output import input_shapes, note_flags
from autobatch.cli._wording import cli_message, python_words
from autobatch.profile import Profile
from autobatch.units import format_bytes

__all__ = ["print_profile", "print_profile_table"]


def device_with_memory(profile: Profile) -> str:
    """``"NVIDIA H100 80GB HBM3 (79.19 GiB)"``, ``"sim (4.00 MiB)"``: the card and its memory."""
    return f"{profile.device_name} ({format_bytes(profile.total_memory_bytes)})"


SHORT_FINGERPRINT_CHARS = 12
"""How much of a model's fingerprint the listing shows (``profiles show`` shows it whole)."""


def model_words(profile: Profile) -> str:
    """How the listing names a profile's model: its recorded name (``gpt2``,
    ``GPT2LMHeadModel``), else, for a profile from before names were recorded, the start of its
    fingerprint."""
    return profile.model_name or profile.model_fingerprint[:SHORT_FINGERPRINT_CHARS] or "-"


def print_profile_table(rows: Sequence[tuple[str, Profile]], out: TextIO) -> None:
    """One line per profile, newest first; MODEL is the model's recorded name (the start of
    its fingerprint where none is recorded), FINGERPRINT the start of its fingerprint."""
    # MODE: an eval profile (a forward only) is no training profile to plan from.
    table = [
        (
            "ID",
            "CREATED (UTC)",
            "DEVICE",
            "MEASURED MAX",
            "RECOMMENDED",
            "MODE",
            "OPTIMIZER",
            "CHECKPOINTING",
            "INPUT",
            "FINGERPRINT",
            "MODEL",
        )
    ]
    table += [
        (
            pid,
            p.created_at[:16].replace("T", " ") or "-",
            device_with_memory(p),
            str(p.max_micro_batch_size),
            str(p.recommended_micro_batch_size),
            p.mode,
            p.optimizer or "-",
            p.activation_checkpointing,
            input_shapes(p.input_shape),
            p.model_fingerprint[:SHORT_FINGERPRINT_CHARS] or "-",
            model_words(p),
        )
        for pid, p in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
        print("  ".join([*cells, row[-1]]), file=out)


def print_profile(profile_id: str, profile: Profile, out: TextIO) -> None:
    """One profile in words: where and under what it was measured, the sizes, the trials."""
    lines: list[tuple[str, Any]] = [
        ("id", profile_id),
        ("created (UTC)", profile.created_at.replace("T", " ") or "-"),
        ("model", profile.model_name or "-"),
        ("model fingerprint", profile.model_fingerprint or "-"),
        ("input", input_shapes(profile.input_shape)),
        ("mode", profile.mode),
        ("optimizer", profile.optimizer or "-"),
        ("checkpointing", f"{profile.activation_checkpointing} (activation checkpointing)"),
        ("device", device_with_memory(profile)),
        ("usable when probed", format_bytes(profile.capacity_bytes)),
        ("node", profile.node_name or "-"),
        ("torch", profile.torch_version or "-"),
        ("driver", profile.driver_version or "-"),
        ("measured max", f"{profile.max_micro_batch_size} (the largest that ran)"),
        (
            "recommended",
            f"{profile.recommended_micro_batch_size} (less the safety margin "
            f"{profile.safety_margin:g}: what a plan from it plans within)",
        ),
        ("trials", f"{profile.num_trials}, {profile.num_ooms} OOM, {profile.method}"),
        (
            "stopped",
            cli_message(profile.stop_reason or profile.stop_kind, note_flags(), bare=False),
        ),
    ]
    for name, value in lines:
        print(f"{name:<20} {value}", file=out)
    for line in profile.conditions.describe():
        print(f"{'condition':<20} {python_words(line)}", file=out)
    for note in profile.notes:
        print(f"note: {cli_message(note, note_flags(), bare=False)}", file=out)
