"""Pydantic schemas of ``POST /v1/admissions``: the job and the site's policy in
(:class:`AdmissionCreate`), the decision out (:class:`AdmissionPublic`).

Example::

    AdmissionCreate.model_validate(
        {"model_fingerprint": "9c1e5b0f7a3d2e48", "effective_batch_size": 1024,
         "cards": ["NVIDIA H100 80GB HBM3"], "world_size": 16}
    )
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, model_validator

from service.admissions.decision import DEFAULT_ALLOWED_WORLD_SIZES, Outcome
from service.plans.schemas import PlanFields, SelectionPublic
from service.web.schemas import Name, NonEmptyName, Size, Strict, WorldSize, distinct, storable_json

__all__ = ["AdmissionCreate", "AdmissionPolicyFields", "AdmissionPublic"]


def distinct_cards(cards: list[str]) -> list[str]:
    """``cards`` when each is named once (the 422 says cards, not world sizes)."""
    repeated = sorted({card for card in cards if cards.count(card) > 1})
    if repeated:
        raise ValueError(f"lists {', '.join(repeated)} more than once: give each card once")
    return cards


class AdmissionPolicyFields(Strict):
    """The site's policy for this job: whether to size it, the GPU counts it may get."""

    size: bool = Field(
        default=False,
        description="Choose the job's GPU count: the fewest allowed GPUs whose plan reaches the "
        "effective batch, or where the profile has step times the fewest within 5% of the "
        "fastest. world_size may then be left out.",
    )
    allowed_world_sizes: Annotated[list[WorldSize], AfterValidator(distinct)] = Field(
        default=list(DEFAULT_ALLOWED_WORLD_SIZES),
        min_length=1,
        max_length=31,
        description="The GPU counts a job may be sized to, and named to a refused job.",
    )
    max_world_size: WorldSize | None = Field(
        default=None,
        description="The most GPUs a job is sized to (a ceiling on the counts); at least the "
        "smallest of allowed_world_sizes.",
    )

    @model_validator(mode="after")
    def _some_count_allowed(self) -> AdmissionPolicyFields:
        """The policy as a whole allows some GPU count: one of ``allowed_world_sizes`` is at
        most ``max_world_size`` (a 422 naming both, not a policy that sizes to nothing)."""
        lowest = min(self.allowed_world_sizes)
        if self.max_world_size is not None and self.max_world_size < lowest:
            raise ValueError(
                f"max_world_size {self.max_world_size} is below every allowed_world_sizes "
                f"({', '.join(map(str, sorted(self.allowed_world_sizes)))}), so no GPU count "
                f"is allowed: raise max_world_size to at least {lowest}, or allow a count of "
                f"at most {self.max_world_size} in allowed_world_sizes"
            )
        return self


class AdmissionCreate(Strict):
    """A job asking to start: its model and effective batch, the cards it may run on, the GPUs
    it asks for, and the site's policy."""

    model_fingerprint: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
    effective_batch_size: Size
    world_size: WorldSize | None = Field(
        default=None,
        description="The GPUs (data-parallel ranks) the job asks for; may be left out when "
        "policy.size is true.",
    )
    cards: Annotated[list[NonEmptyName], AfterValidator(distinct_cards)] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="Candidate card types in the job's order of preference (profiles' "
        "device_name, e.g. 'NVIDIA H100 80GB HBM3'); null plans from the model's profile "
        "drawn among the nodes, on the card the most nodes measured.",
    )
    conditions: Annotated[dict[Name, Any], AfterValidator(storable_json)] | None = Field(
        default=None, max_length=64, description="As for POST /v1/plan; needs cards."
    )
    multiple_of: int = Field(default=1, ge=1, le=2**20)
    policy: AdmissionPolicyFields = Field(default_factory=AdmissionPolicyFields)

    @model_validator(mode="after")
    def _asks_something(self) -> AdmissionCreate:
        if self.world_size is None and not self.policy.size:
            raise ValueError(
                "give world_size (the GPUs the job asks for), or set policy.size to true to "
                "have the job sized"
            )
        if self.conditions is not None and self.cards is None:
            raise ValueError("conditions need cards: the card types the job may run on")
        return self


class AdmissionPublic(BaseModel):
    """The decision, the allocation, the plan and the reasons."""

    outcome: Outcome = Field(
        description="'accepted': run as asked with plan; 'sized': run on world_size GPUs of "
        "card with plan; 'unreachable': refuse (no plan reaches the effective batch at the "
        "asked count); 'unplanned': admit unchanged (no profile of the model)."
    )
    card: str | None
    world_size: int | None
    plan: PlanFields | None
    profile_id: str | None
    selection: SelectionPublic | None
    reasons: list[str]
    message: str = Field(description="The reasons in one line, for the user at submission.")
    nearest_effective_batch_sizes: list[int]
    reaching_world_sizes: list[int]
    environment: dict[str, str] = Field(
        description="The plan as the variables a trainer reads (as `autobatch plan --env` "
        "writes them: AUTOBATCH_MICRO_BATCH_SIZE, ...), empty without a plan."
    )
