"""CLI text speaks sizes in units (format_bytes), never raw byte counts: a profile's stop
reason and notes, a plan's notes, errors (issue 46)."""

from __future__ import annotations

import io

from autobatch.cli._output import note_flags
from autobatch.cli._profiles import print_profile
from autobatch.cli._wording import cli_message, human_bytes
from autobatch.profile import Profile


def test_byte_counts_read_in_units() -> None:
    assert human_bytes("confirmed by one real trial (peak 7535104 bytes)") == (
        "confirmed by one real trial (peak 7.19 MiB)"
    )
    assert human_bytes("the memory line, 2208870 + 666215 bytes per sample, raised") == (
        "the memory line, 2.11 MiB + 650.60 KiB per sample, raised"
    )
    assert human_bytes("(largest residual 4096 bytes)") == "(largest residual 4.00 KiB)"
    assert human_bytes("'80' is 80 bytes; 2**30 bytes per GiB") == (
        "'80' is 80 bytes; 2**30 bytes per GiB"
    )
    exact = "needs 4.00 GiB (4294967296 bytes) at"  # the units first, the exact count beside
    assert human_bytes(exact) == exact
    assert human_bytes("slope 1.5e+05 bytes per sample") == "slope 1.5e+05 bytes per sample"
    assert cli_message("peak 1048576 bytes", note_flags(), bare=False) == "peak 1.00 MiB"
    assert cli_message("peak 1048576 bytes", {}) == "peak 1.00 MiB"


def test_profiles_show_words_its_stop_and_notes_for_the_command_line() -> None:
    profile = Profile(
        device_name="sim",
        total_memory_bytes=2**26,
        capacity_bytes=2**26,
        max_micro_batch_size=16,
        recommended_micro_batch_size=16,
        safety_margin=0.05,
        method="probe",
        trials=(),
        num_steps=2,
        device_type="sim",
        stop_kind="limit",
        stop_reason="limit max_micro_batch_size=16 reached",
        notes=("predicted from another card: confirmed by one real trial (peak 7535104 bytes)",),
    )
    out = io.StringIO()
    print_profile("abc", profile, out)
    text = out.getvalue()
    assert "stopped              limit --max-micro-batch-size 16 reached\n" in text
    assert "note: predicted from another card: confirmed by one real trial (peak 7.19 MiB)" in text
    assert "max_micro_batch_size" not in text and "bytes" not in text
