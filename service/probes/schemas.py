"""``/v1/probes``' request and answer bodies (pydantic): a probe run of a registered model.

Example::

    ProbeCreate(model="my-model", device="cuda:1")
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from service.probes.runs import ProbeRunStatus as ProbeRunStatus
from service.web.schemas import DeviceName, StoredProfile, StoredTrial, Strict

__all__ = ["ProbeCreate", "ProbeList", "ProbeProgress", "ProbePublic"]


class ProbeCreate(Strict):
    """A probe of a model registered in the server's config file (never code named here)."""

    model: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    device: DeviceName | None = Field(
        default=None, description="Override the registered device, e.g. 'cuda:1'."
    )
    refresh: bool = Field(
        default=False,
        description="Probe even when a stored profile of this model on this device still "
        "answers (by default such a job finishes at once with that profile).",
    )


class ProbeProgress(BaseModel):
    num_trials: int
    num_ooms: int
    largest_fitting_micro_batch_size: int
    last_trial: StoredTrial | None


class ProbePublic(BaseModel):
    id: str
    model: str
    device: str
    status: ProbeRunStatus
    created_at: str
    started_at: str | None
    finished_at: str | None
    queue_position: int | None
    child_pid: int | None
    progress: ProbeProgress
    cached: bool
    """True when the job answered from the store without running a step."""
    profile_id: str | None
    profile: StoredProfile | None
    error: str


class ProbeList(BaseModel):
    probes: list[ProbePublic]
