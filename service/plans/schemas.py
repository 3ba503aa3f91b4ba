"""Pydantic schemas of ``POST /v1/plan``: the request (:class:`PlanCreate`: the limit's source,
the device, the job's cards, the planner's options) and the answer (:class:`PlanPublic`: the
plan, the frameworks' configs, the world-size table, the selection, each rank group's plan).

The shared field types (sizes, names, devices, budgets) are :mod:`service.web.schemas`'.

Example::

    PlanCreate.model_validate({"effective_batch_size": 1024, "max_micro_batch_size": 32})
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from autobatch.conditions import one_world_size
from autobatch.errors import ConfigError
from autobatch.planning import AskedCheckpointing, Match, PlanSource, Uneven
from autobatch.profile import CheckpointingMode
from autobatch.units import check_capacity_bytes
from service.web.schemas import (
    MAX_ACCUMULATION_STEPS,
    MAX_WORLD_SIZE,
    ConditionsFields,
    DeviceSpec,
    GpuFraction,
    GradientSyncFields,
    Id,
    MemoryBudgetBase,
    MemoryModelBase,
    Name,
    NonEmptyName,
    PositiveBytes,
    ResolvedDevice,
    SafetyMargin,
    Size,
    Strict,
    WorldSize,
    distinct,
    storable_json,
)
from service.web.wording import describe

__all__ = [
    "EpochFields",
    "JobCards",
    "PlanConfigs",
    "PlanCreate",
    "PlanFields",
    "PlanPublic",
    "PredictionFields",
    "RankGroupPublic",
    "SelectionPublic",
    "WorldSizeOptionPublic",
]


class JobCards(Strict):
    """One kind of card in a job on mixed cards: the card type and how many of its cards the job
    holds (one data-parallel rank per card). ``count`` counts cards of one type; the job's
    ``world_size`` is the sum of its entries' counts."""

    card: Annotated[str, Field(min_length=1, max_length=256)] = Field(
        description="The card type (a profile's device_name, e.g. 'NVIDIA L40S')."
    )
    count: WorldSize = Field(
        description="Cards of this type in the job, one data-parallel rank each; the job's "
        "world size is the sum of the counts."
    )
    capacity_bytes: PositiveBytes | None = Field(
        default=None,
        description="The memory each of these cards gives a rank, in bytes (at least 1 MiB): "
        "a card no stored profile was measured on is planned for it from another card's "
        "profile ('predicted'); a card with its own profiles is planned for this budget.",
    )

    @field_validator("capacity_bytes")
    @classmethod
    def _a_device_size(cls, value: int | None) -> int | None:
        """The library's one check of a device's memory (under 1 MiB: a unit left off)."""
        if value is None:
            return None
        try:
            return check_capacity_bytes(value)
        except ConfigError as exc:
            raise ValueError(describe(exc)) from None


class PlanCreate(Strict):
    """What to plan: exactly one limit (a stored profile, a model's profile drawn among the
    nodes, a plain max micro-batch size, or a memory model), an optional device, and the batch
    to reach."""

    profile_id: Id | None = None
    model_fingerprint: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = None
    max_micro_batch_size: Size | None = Field(
        default=None,
        description="A given limit to plan within: the largest micro-batch known to fit (not a "
        "search cap; a profile's measured maximum comes with profile_id or model_fingerprint).",
    )
    memory_model: MemoryModelBase | None = None
    device: DeviceSpec | None = None
    card: NonEmptyName | None = Field(
        default=None,
        description="Plan for this card type (a profile's device_name, e.g. 'NVIDIA H100 80GB "
        "HBM3'): a profile of model_fingerprint measured on it under the conditions asked, "
        "drawn among the nodes (each node's latest, no node alone deciding), answers "
        "'measured'; otherwise a profile measured elsewhere "
        "answers 'predicted' (see the answer's selection). Needs model_fingerprint.",
    )
    node: NonEmptyName | None = Field(
        default=None,
        description="Plan for this node (a profile's node_name): its own profile of "
        "model_fingerprint first, then the card's as for card. Needs model_fingerprint.",
    )
    conditions: Annotated[dict[Name, Any], AfterValidator(storable_json)] | None = Field(
        default=None,
        max_length=64,
        description="Conditions the plan must hold under (names of a profile's conditions, "
        "e.g. {'amp_dtype': 'bfloat16'}, and the job's software: torch_version, "
        "driver_version): a profile recorded under others answers 'predicted', and the "
        "selection's reasons name each difference. Needs card, node or job.",
    )
    activation_checkpointing: AskedCheckpointing | None = Field(
        default=None,
        description="With model_fingerprint: plan from the model's profile measured under "
        "this activation checkpointing mode ('none', 'selective', 'full'), drawn among the "
        "nodes as a plan by the model alone, or 'auto': from the one drawn under each mode, "
        "the one whose plan reaches the effective batch "
        "in the least time per optimizer step (within 5% or the measured noise of the times, "
        "whichever is larger, or untimed: the least recompute), a "
        "mode whose measured peak is not below the plain one's never. Null: the mode "
        "conditions name, else 'none' (the job trains as the model is: only profiles measured "
        "without checkpointing plan it). With card or node, the profile of the mode is chosen "
        "among the nodes as for any plan by card ('auto': each mode's so chosen, then the "
        "choice among modes); with job ('none', 'selective' or 'full'), every card's profile "
        "is of the mode.",
    )
    effective_batch_size: Size
    world_size: WorldSize = 1
    data_parallel_size: WorldSize | None = Field(
        default=None,
        description="An accepted alias of world_size (give one; both given must agree): "
        "data-parallel ranks, with tensor or pipeline parallelism the number of model "
        "replicas, not of GPUs.",
    )
    world_sizes: Annotated[list[WorldSize], AfterValidator(distinct)] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="Also plan at each of these world sizes (e.g. [1, 2, 4, 8]): the answer's "
        "world_size_options table.",
    )
    multiple_of: int = Field(default=1, ge=1, le=2**20)
    max_gradient_accumulation_steps: int | None = Field(
        default=None, ge=1, le=MAX_ACCUMULATION_STEPS
    )
    uneven: Uneven = "auto"
    allow_inexact: bool = False
    safety_margin: SafetyMargin | None = None
    job: list[JobCards] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="A job on mixed cards, e.g. [{'card': 'NVIDIA H100 80GB HBM3', 'count': "
        "4}, {'card': 'NVIDIA L40S', 'count': 4}]: ranks in this order, a micro-batch per "
        "rank from each card's profile of model_fingerprint (measured there or predicted, as "
        "for card) and one gradient_accumulation_steps; the answer's ranks give each card's "
        "plan. Each count is a number of cards of that type; the job's world size is the sum "
        "of the counts. Needs model_fingerprint; not with card, node, device, world_sizes, "
        "allow_inexact or gpu_fraction.",
    )
    gpu_fraction: GpuFraction | None = Field(
        default=None,
        description="The share of the device's card the job gets (0 < x <= 1; Ray's "
        "num_gpus=0.5 is 0.5), e.g. two trials on one card: the plan is for that share of its "
        "memory, and plan.budget.trials_per_gpu says how many such jobs fit on a card. Needs a "
        "device.",
    )

    @model_validator(mode="after")
    def _one_limit(self) -> PlanCreate:
        if self.data_parallel_size is not None:
            # The alias, reconciled as on every surface; world_size holds the answer.
            said = self.world_size if "world_size" in self.model_fields_set else None
            self.world_size = one_world_size(said, self.data_parallel_size) or self.world_size
        given = [
            name
            for name in ("profile_id", "model_fingerprint", "max_micro_batch_size", "memory_model")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of profile_id, model_fingerprint, max_micro_batch_size, "
                "memory_model; got " + (", ".join(given) or "none")
            )
        if (self.card is not None or self.node is not None) and self.model_fingerprint is None:
            raise ValueError(
                "card and node choose among the stored profiles of a model: give "
                "model_fingerprint with them"
            )
        if self.conditions is not None and self.card is None and self.node is None and not self.job:
            raise ValueError(
                "conditions need card or node, or a job: the card types or node planned for"
            )
        if self.job is not None:
            self._check_job(self.job)
        if self.activation_checkpointing is not None:
            self._check_checkpointing()
        inner = None if self.device is None else self.device.gpu_fraction
        if self.gpu_fraction is not None and inner is not None and inner != self.gpu_fraction:
            raise ValueError(
                f"gpu_fraction {self.gpu_fraction} and device.gpu_fraction {inner} disagree; "
                "give one"
            )
        return self

    def _check_checkpointing(self) -> None:
        if self.model_fingerprint is None:
            raise ValueError(
                "activation_checkpointing chooses among the stored profiles of a model: give "
                "model_fingerprint with it"
            )
        if self.job is not None and self.activation_checkpointing == "auto":
            raise ValueError(
                "a job trains every card under one activation checkpointing mode, and 'auto' "
                "chooses per card: give activation_checkpointing 'none', 'selective' or 'full' "
                "with job (or plan each card with 'auto' and card to compare)"
            )

    def _check_job(self, job: list[JobCards]) -> None:
        if self.model_fingerprint is None:
            raise ValueError(
                "job plans from each card's profiles of a model: give model_fingerprint"
            )
        others = [
            name
            for name in ("card", "node", "device", "world_sizes", "gpu_fraction")
            if getattr(self, name) is not None
        ]
        if self.allow_inexact:
            others.append("allow_inexact")
        if others:
            raise ValueError(
                f"{', '.join(others)} do(es) not go with job, which gives each rank's card (a "
                "mixed plan meets the effective batch exactly or names the nearest reachable ones)"
            )
        cards = [entry.card for entry in job]
        if len(set(cards)) != len(cards):
            raise ValueError(f"job names a card more than once ({cards}); give each card once")
        total = sum(entry.count for entry in job)
        if total > MAX_WORLD_SIZE:
            raise ValueError(f"job has {total} ranks in all, more than {MAX_WORLD_SIZE}")
        if self.world_size not in (1, total):
            raise ValueError(
                f"world_size {self.world_size} is not the job's {total} ranks; leave it out "
                "with job"
            )

    @property
    def declared_fraction(self) -> float | None:
        """``gpu_fraction``, or ``device.gpu_fraction``; None when neither is given."""
        if self.gpu_fraction is not None or self.device is None:
            return self.gpu_fraction
        return self.device.gpu_fraction


class PredictionFields(BaseModel):
    """``autobatch.planning._prediction.Prediction``: how a limit past the largest measured
    micro-batch
    was predicted."""

    largest_measured_micro_batch_size: int
    num_fit_points: int
    fit_residual_bytes: int
    fixed_bytes: int
    bytes_per_sample: int
    margin: float


class EpochFields(BaseModel):
    """``autobatch.planning._epochs.EpochPlan``: one epoch of data under a plan, per rank."""

    num_rows_per_rank: int
    drop_last: bool
    num_micro_batches_per_rank: int
    num_optimizer_steps: int
    num_full_steps: int
    last_step_micro_batches: int
    last_effective_batch_size: int


class PlanFields(BaseModel):
    """``autobatch.Plan.to_dict()``. A uniform plan (``rank_micro_batch_sizes`` null):
    ``sum(micro_batch_sizes) * world_size == effective_batch_size``. A mixed plan (ranks on
    different cards, one plan per rank): ``sum(rank_micro_batch_sizes) *
    gradient_accumulation_steps == effective_batch_size``, with ``world_size`` sizes in rank
    order, and this rank's ``micro_batch_sizes`` are ``gradient_accumulation_steps`` equal
    micro-batches of ``micro_batch_size``, its own entry of ``rank_micro_batch_sizes``."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    effective_batch_size: int
    requested_effective_batch_size: int
    micro_batch_sizes: list[int]
    rank_micro_batch_sizes: list[int] | None = None
    exact: bool
    max_micro_batch_size: int
    predicted_peak_memory_bytes: int | None
    capacity_bytes: int | None
    headroom_bytes: int | None
    predicted_seconds_per_effective_batch: float | None
    eval_micro_batch_size: int | None = None
    source: PlanSource
    prediction: PredictionFields | None = None
    notes: list[str]
    budget: MemoryBudgetBase | None = Field(
        default=None,
        description="The memory the job really has on the device planned for: every source, "
        "the deciding one, the sharing mode, fits_now and trials_per_gpu; null without a device.",
    )
    conditions: ConditionsFields | None = None
    gradient_sync: GradientSyncFields | None = None
    activation_checkpointing: CheckpointingMode = Field(
        default="none",
        description="The activation checkpointing mode to train with ('none': the model as "
        "given; 'selective': every 2nd repeated block; 'full': every block).",
    )
    epoch: EpochFields | None = None


class PlanConfigs(BaseModel):
    """Ready settings for the frameworks; null with a ``reason`` when the plan's micro-batches
    are of unequal size, or differ by rank (a mixed plan), which those frameworks cannot
    express."""

    deepspeed: dict[str, Any] | None
    hf_training_arguments: dict[str, Any] | None
    lightning: dict[str, dict[str, Any]] | None
    reason: str | None = None


class WorldSizeOptionPublic(BaseModel):
    world_size: int
    plan: PlanFields | None
    reason: str


class SelectionPublic(BaseModel):
    """Which stored profile answered a plan for a card or a node
    (``autobatch.planning._selection.Selection``)."""

    match: Match = Field(
        description="'measured': a profile measured on the card (and node) asked about under "
        "the conditions asked; 'estimated': the same from an estimate; 'predicted': measured "
        "elsewhere or under other conditions, so the plan is a prediction for that card."
    )
    profile_id: str
    node_name: str = Field(description="Where the profile was measured ('' if unrecorded).")
    device_name: str = Field(description="The card the profile was measured on.")
    card: str | None = Field(description="The card type planned for; null when unknown.")
    reasons: list[str] = Field(description="Why the match is not 'measured'.")
    considered: list[str] = Field(
        default_factory=list,
        description="The ids of the stored profiles the answer was drawn among, one per node "
        "(its latest with the chosen one's card, budget and conditions, and node when asked), in "
        "id order: however often a node published, and in whatever order.",
    )
    max_micro_batch_size_range: list[int] = Field(
        default_factory=list,
        description="The smallest and largest max_micro_batch_size among considered.",
    )
    basis: str = Field(default="", description="Why the chosen one of them, in words.")
    outliers: list[str] = Field(
        default_factory=list,
        description="Nodes whose max_micro_batch_size lies outside what all the other nodes "
        "measured: with three nodes or more the answer is the second most conservative, so no "
        "one node moves it outside what the others support.",
    )
    rests_on: str | None = Field(
        default=None,
        description="With one or two nodes: the node whose word the answer rests on ('' when "
        "its profile names none); null when at least two other nodes bound the answer.",
    )
    lower_bounds: list[str] = Field(
        default_factory=list,
        description="Nodes whose search stopped at a cap (a lower bound of the maximum, not a "
        "maximum), set aside because other nodes measured the maximum.",
    )
    measured_max_micro_batch_size: int | None = Field(
        default=None,
        description="The chosen profile's measured maximum: the largest micro-batch that ran "
        "in its trials. The plan's max_micro_batch_size is the recommended limit it planned "
        "within (that maximum less the safety margin, or scaled to the card asked about).",
    )
    measured_under: dict[str, str] = Field(
        default_factory=dict,
        description="What the chosen profile was measured under, as recorded: node_name, "
        "device_name, torch_version, driver_version and the conditions that move memory "
        "(amp_dtype, optimizer, activation_checkpointing; on CUDA allocator_settings, "
        "allocator_backend, cudnn; world_size). Where the job's own, named in conditions "
        "(torch_version and driver_version among them), differ, reasons say so.",
    )


class RankGroupPublic(BaseModel):
    """The ranks of one card of a ``job``: their plan (one mixed plan's, this card's micro-batch)
    and the profile it came from."""

    card: str
    count: int
    first_rank: int = Field(description="The first of this card's ranks (they are consecutive).")
    plan: PlanFields
    profile_id: str
    selection: SelectionPublic


class PlanPublic(BaseModel):
    plan: PlanFields
    configs: PlanConfigs
    world_size_options: list[WorldSizeOptionPublic] | None = None
    profile_id: str | None = None
    device: ResolvedDevice | None = None
    selection: SelectionPublic | None = None
    ranks: list[RankGroupPublic] | None = Field(
        default=None,
        description="For a job: each card's ranks and plan, in rank order; plan, profile_id "
        "and selection above are rank 0's.",
    )
