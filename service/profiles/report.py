"""``GET /v1/profiles/{id}/report``'s answer: the data of ``autobatch tune --report``'s page for a
stored profile (:func:`autobatch.planning.profile_report`), so a dashboard draws what the CLI
draws."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["ProfileReport"]


class ReportTrial(BaseModel):
    """One real trial of the probe (its warm-up left out)."""

    micro_batch_size: int
    fits: bool
    oom: bool = Field(description="It failed for want of memory (not for another error).")
    peak_memory_bytes: int | None = Field(description="Measured peak; null where it did not fit.")
    seconds_per_sample: float | None = Field(
        description="The step's time over its micro-batch; null where it did not fit or was "
        "not timed."
    )


class ReportMode(BaseModel):
    """The trials of one activation checkpointing mode."""

    mode: str = Field(description="'none', 'selective' or 'full'.")
    capacity_bytes: int = Field(description="The memory the probe had, bytes.")
    trials: list[ReportTrial]


class ReportChosen(BaseModel):
    """The chosen point: the profile's recommended micro-batch."""

    activation_checkpointing: str
    micro_batch_size: int
    gradient_accumulation_steps: int | None = Field(
        description="Null for a profile alone (a plan chooses it for an effective batch)."
    )
    predicted_peak_memory_bytes: int | None = Field(
        description="From the profile's memory line at micro_batch_size; null without a line."
    )


class ProfileReport(BaseModel):
    """Peak memory and time per sample against micro-batch, per mode, and the chosen point."""

    capacity_bytes: int
    modes: list[ReportMode]
    chosen: ReportChosen
    why: list[str] = Field(description="Why that mode was chosen (empty for a lone mode).")
