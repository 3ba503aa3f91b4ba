"""PURE: what a tuning report draws, as JSON-ready data: for each activation checkpointing mode
its trials (micro-batch, fits or OOM, measured peak bytes, seconds per sample) and the memory it
had, and the chosen point. The library's HTML report (:func:`autobatch.tuning.report_html`) and
the service's ``GET /v1/profiles/{id}/report`` draw from the same functions, so a page and an
answer never disagree.

Example::

    profile_report(profile)["chosen"]["micro_batch_size"]   # its recommended micro-batch
"""

from __future__ import annotations

from typing import Any

from autobatch.profile import Profile

__all__ = ["mode_report", "profile_report"]


def mode_report(mode: str, profile: Profile) -> dict[str, Any]:
    """One mode's part of a report: ``mode``, ``capacity_bytes`` (the memory the probe had,
    bytes) and ``trials``, each real trial (the warm-up left out) as ``micro_batch_size``,
    ``fits``, ``oom``, ``peak_memory_bytes`` (measured; None where it did not fit) and
    ``seconds_per_sample`` (the step's time over its micro-batch; None where it did not fit or
    was not timed)."""
    trials = [
        {
            "micro_batch_size": trial.micro_batch_size,
            "fits": trial.fits,
            "oom": trial.oom,
            "peak_memory_bytes": trial.peak_allocated_bytes if trial.fits else None,
            "seconds_per_sample": trial.step_seconds / trial.micro_batch_size
            if trial.fits and trial.step_seconds > 0
            else None,
        }
        for trial in profile.trials
        if not trial.warm_up
    ]
    return {"mode": mode, "capacity_bytes": profile.capacity_bytes, "trials": trials}


def profile_report(profile: Profile) -> dict[str, Any]:
    """A stored profile's report: its one mode (``profile.activation_checkpointing``) and, as
    the chosen point, its recommended micro-batch, whose peak is predicted from the profile's
    memory line (None without one). ``gradient_accumulation_steps`` is None (no batch was asked:
    a plan chooses it) and ``why`` empty, as the library's report of a lone mode has it."""
    line = profile.memory_model
    chosen = profile.recommended_micro_batch_size
    return {
        "capacity_bytes": profile.capacity_bytes,
        "modes": [mode_report(profile.activation_checkpointing, profile)],
        "chosen": {
            "activation_checkpointing": profile.activation_checkpointing,
            "micro_batch_size": chosen,
            "gradient_accumulation_steps": None,
            "predicted_peak_memory_bytes": None
            if line is None
            else line.fixed_bytes + line.bytes_per_sample * chosen,
        },
        "why": [],
    }
