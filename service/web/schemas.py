"""The schemas every feature shares (pydantic): the bounded field types (sizes, bytes, names, a
device, a safety margin, a gpu_fraction), a device and its budget, and a profile's blocks, in the
Base / Create / Public split. Each feature's own bodies live with it (``service.plans.schemas``,
``service.probes.schemas``).

Every number a client sends is bounded (sizes up to ``2**31 - 1``, world sizes up to 65536, bytes up
to ``2**60``), every string is length-limited (``MAX_NAME_CHARS``, ``MAX_TEXT_CHARS``) and
storable on every store backend (no NUL, no lone surrogate: ``autobatch.store._storable``), so
bad input is a 4xx problem, the same on SQLite and PostgreSQL, and never reaches the library as
something it cannot handle.

Example::

    class ProbeCreate(Strict):
        device: DeviceName | None = None     # checked by the library's parser
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from autobatch.conditions import RENAMED_KEYS
from autobatch.device import (
    MAX_GPU_FRACTION,
    MIN_GPU_FRACTION,
    BudgetSource,
    CardMemory,
    CardSource,
    MemorySource,
    SharingMode,
    parse_device,
)
from autobatch.errors import ConfigError
from autobatch.margin import MAX_SAFETY_MARGIN, MIN_SAFETY_MARGIN, check_safety_margin
from autobatch.planning import MAX_GRADIENT_ACCUMULATION_STEPS
from autobatch.profile import (
    PROFILE_SCHEMA_VERSION,
    CheckpointingMode,
    Clock,
    Compiled,
    Method,
    Mode,
    StopKind,
    SyncMode,
)
from autobatch.store import unstorable, unstorable_in

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_TEXT_CHARS",
    "BudgetReadingBase",
    "ConditionsFields",
    "DeviceList",
    "DeviceSpec",
    "GpuPublic",
    "IdPath",
    "MemoryBudgetBase",
    "MemoryModelBase",
    "ProfileBase",
    "ProfileCreate",
    "ProfileList",
    "ProfilePublic",
    "ResolvedDevice",
    "StoredProfile",
    "StoredTrial",
    "TrialBase",
    "storable",
]

MAX_SIZE = 2**31 - 1
"""Largest micro-batch or effective batch size accepted: what a 32-bit column holds (PostgreSQL's
``integer``, the store's micro-batch columns), so a size the schema takes is stored on every
backend; no real micro-batch comes near it."""
MAX_WORLD_SIZE = 65536
MAX_BYTES = 2**60
MAX_ACCUMULATION_STEPS = MAX_GRADIENT_ACCUMULATION_STEPS
"""The planner's own bound (2**20), so the service and ``autobatch plan`` take the same."""


MAX_TEXT_CHARS = 4096
"""The longest string a request may hold anywhere (a note, an error, a setting's value)."""
MAX_NAME_CHARS = MAX_TEXT_CHARS // 16
"""The longest name (a card, a node, a model fingerprint, a dictionary key): 256."""


def storable(value: str) -> str:
    """The one check of every string a request holds: a 422 for text a store backend cannot
    hold (``autobatch.store._storable``), on every backend alike.

    Raises:
        ValueError: ``value`` holds a NUL or a lone surrogate (pydantic makes it a 422).
    """
    why = unstorable(value)
    if why is not None:
        raise ValueError(f"the text {why}; remove that character")
    return value


def storable_json(value: Any) -> Any:
    why = unstorable_in(value)
    if why is not None:
        raise ValueError(f"{why}; remove that character")
    return value


def distinct(values: list[int]) -> list[int]:
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise ValueError(
            f"lists {', '.join(map(str, repeated))} more than once: each world size is one row "
            "of the table, give each once"
        )
    return values


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(storable)]
LongText = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(storable)]
NonEmptyName = Annotated[
    str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(storable)
]
IdPath = Annotated[str, Path(max_length=64), AfterValidator(storable)]
"""A profile's or probe run's id in a path: the store's ids are 16 hex digits; anything else is
simply not stored (404), but never text a backend cannot compare with (422)."""
Size = Annotated[int, Field(ge=1, le=MAX_SIZE)]
Count = Annotated[int, Field(ge=0, le=MAX_SIZE)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
PositiveBytes = Annotated[int, Field(ge=1, le=MAX_BYTES)]
WorldSize = Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
GpuFraction = Annotated[float, Field(gt=MIN_GPU_FRACTION, le=MAX_GPU_FRACTION)]
BudgetSourceName = BudgetSource
"""The library's budget sources, one list (the answer's schema names them)."""
SharingModeName = SharingMode


def check_device(device: str) -> str:
    """A device string the library understands (:func:`autobatch.device.parse_device`, the one
    parser), for pydantic fields; raises ``ValueError`` naming the accepted forms."""
    try:
        parse_device(device)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return device


DeviceName = Annotated[
    str,
    Field(
        max_length=64,
        description="'cuda:N', 'cpu' or 'sim:SIZE' (a simulated card, e.g. 'sim:16GiB')",
        examples=["cuda:0", "cpu", "sim:16GiB"],
    ),
    AfterValidator(check_device),
]
"""A device a probe may run on, checked by the library's parser."""


def check_margin(value: float) -> float:
    """A safety margin the library accepts (:func:`autobatch.margin.check_safety_margin`, the one
    check of its range), for pydantic fields; raises ``ValueError`` with the library's words."""
    try:
        return check_safety_margin(value)
    except ConfigError as exc:
        raise ValueError(exc.message) from None


SafetyMargin = Annotated[
    float,
    Field(
        description="Fraction of the device's capacity kept free, in [0, 1)",
        # The schema states the library's range; the check is the library's (check_margin).
        json_schema_extra={"minimum": MIN_SAFETY_MARGIN, "exclusiveMaximum": MAX_SAFETY_MARGIN},
    ),
    AfterValidator(check_margin),
]
"""A safety margin, checked by the library."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# -- devices -----------------------------------------------------------------------------------


class DeviceSpec(Strict):
    """The device to plan for: exactly one of a local GPU (``cuda_index`` or ``uuid``), a
    capacity in bytes, or Kubernetes GPU feature discovery labels."""

    cuda_index: int | None = Field(default=None, ge=0, le=1023)
    uuid: Annotated[str, Field(pattern=r"^(GPU|MIG)-[0-9A-Za-z-]{1,96}$")] | None = None
    capacity_bytes: PositiveBytes | None = None
    node_labels: dict[Name, Name] | None = Field(
        default=None,
        max_length=256,
        description="Node labels including 'nvidia.com/gpu.memory' (MiB) and, optionally, "
        "'nvidia.com/gpu.product'; on a MIG node (mixed strategy) the slices' "
        "'nvidia.com/mig-<profile>.memory'.",
    )
    mig_profile: Annotated[str, Field(pattern=r"^[0-9]+g\.[0-9]+gb(\+[a-z0-9]+)?$")] | None = Field(
        default=None,
        description="With node_labels on a MIG node: the slice the job gets, e.g. '1g.5gb'; "
        "the plan is for the slice's memory, not the card's.",
    )
    memory: CardMemory = Field(
        default="total",
        description="For a local GPU: plan for its total memory (the job will own it) or what "
        "is free now.",
    )
    gpu_fraction: GpuFraction | None = Field(
        default=None,
        description="The share of this card the job gets (0 < x <= 1; Ray's num_gpus=0.5 is "
        "0.5): the plan is for that share of its memory. The same as the body's gpu_fraction.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> DeviceSpec:
        given = [
            name
            for name in ("cuda_index", "uuid", "capacity_bytes", "node_labels")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of cuda_index, uuid, capacity_bytes, node_labels; got "
                + (", ".join(given) or "none")
            )
        if self.mig_profile is not None and self.node_labels is None:
            raise ValueError(
                "mig_profile goes with node_labels; for a local MIG slice give its uuid "
                "('MIG-...'), or give capacity_bytes"
            )
        return self


class ResolvedDevice(BaseModel):
    """The device a plan was made for."""

    source: CardSource
    capacity_bytes: int = Field(
        description="What the plan was made for: the memory budget, the smallest of its sources "
        "(plan.budget lists them)."
    )
    deciding_source: BudgetSourceName | None = Field(
        default=None, description="The budget source that decided capacity_bytes."
    )
    sharing_mode: SharingModeName | None = Field(
        default=None, description="How the device is shared, as plan.budget says."
    )
    name: str | None = None
    uuid: str | None = None
    cuda_index: int | None = None
    mig_profile: str | None = None
    memory_source: str | None = Field(
        default=None, description="For a local GPU: 'nvml', 'cuda_runtime' or 'host'."
    )
    sampled_at: float | None = Field(
        default=None, description="For a local GPU: Unix time of the memory reading."
    )
    age_seconds: float | None = Field(default=None, description="The reading's age.")
    memory_held_by_others_bytes: int | None = Field(
        default=None,
        description="For a local GPU: bytes other processes hold on it now (NVML 'used'; with "
        "the v1 memory API this includes the driver's reserve).",
    )
    note: str | None = Field(
        default=None,
        description="Set when a plan for memory 'total' assumes memory other processes hold "
        "now will be gone; plan with memory 'free' to leave room for them.",
    )
    warnings: list[str] = []
    """What was corrected in reading the device (a memory label in bytes, NVML over a label)."""


class GpuPublic(BaseModel):
    """One GPU or MIG instance as NVML lists it (bytes; null where not known)."""

    nvml_index: int
    cuda_index: int | None = Field(
        description="CUDA's index in the device set this container was given; null outside it."
    )
    uuid: str
    name: str
    total_memory_bytes: int | None
    free_memory_bytes: int | None
    used_memory_bytes: int | None
    reserved_memory_bytes: int | None = Field(
        description="The driver's reserve (NVML v2); null when not reported."
    )
    used_includes_reserved: bool = Field(
        description="'used' counts the driver's reserve (NVML's v1 memory API)."
    )
    memory_source: MemorySource
    unified_memory: bool
    is_mig: bool
    parent_uuid: str
    mig_profile: str = Field(description="A MIG instance's profile, e.g. '3g.40gb'.")
    given: bool = Field(
        description="Given to this container (NVIDIA_VISIBLE_DEVICES); false for the other "
        "cards a privileged pod sees, which are never planned on."
    )
    memory_reason: str | None = Field(
        description="Why the memory is not NVML's or is unknown: a stable reason code."
    )
    memory_detail: str | None
    sampled_at: float = Field(description="Unix time of the reading.")
    age_seconds: float


class DeviceList(BaseModel):
    """This node's GPUs; empty with a reason code and detail when NVML is unavailable."""

    devices: list[GpuPublic]
    reason: str | None = Field(
        default=None,
        description=(
            "Why the list is empty or incomplete: a stable code (docs/service.md lists them)."
        ),
    )
    detail: str | None = None
    note: str | None = Field(
        default=None,
        description="About the device set: cards NVML sees that this container was not given, "
        "or how CUDA's numbering was chosen.",
    )


# -- memory budgets ----------------------------------------------------------------------------


class BudgetReadingBase(Strict):
    """One memory source (``autobatch.device.BudgetReading``), bytes."""

    source: BudgetSourceName
    total_bytes: Bytes = Field(
        description="The memory the source says the device has, or the limit it sets."
    )
    available_bytes: Bytes = Field(description="What the job may use by this source.")
    free_bytes: Bytes | None = Field(
        default=None, description="Free now by this source; null when it does not read it."
    )
    detail: LongText = ""


class MemoryBudgetBase(Strict):
    """The memory a job really has (``autobatch.device.MemoryBudget``): every source read, the
    smallest (``budget_bytes``, decided by ``deciding_source``) and how the device is shared."""

    budget_bytes: Bytes
    deciding_source: BudgetSourceName
    sharing_mode: SharingModeName = Field(
        description="'none' when the sources agree within 5%; else 'shared' (others hold "
        "memory), 'virtualised' (a CUDA runtime or vGPU limit below the card), 'fractional' "
        "(a declared or per-process fraction), 'time_sliced' (device-plugin replicas), 'mps' "
        "(an MPS client's memory limit), 'container_limited' (a cgroup below the host)."
    )
    readings: list[BudgetReadingBase] = Field(min_length=1, max_length=64)
    card_memory_bytes: Bytes = Field(
        description="The whole card as the container sees it (no fraction): what "
        "trials_per_gpu divides."
    )
    free_now_bytes: Bytes | None = None
    unseen_sources: list[Name] = Field(
        default_factory=list,
        max_length=64,
        description="Sources that may limit the job but could not be read (the service cannot "
        "read the CUDA runtime of the job's container): the budget is not vouched for.",
    )
    warnings: list[LongText] = Field(default_factory=list, max_length=64)
    fits_now: bool | None = Field(
        default=None,
        description="On a plan: its predicted peak fits what is free on the device now.",
    )
    trials_per_gpu: Count | None = Field(
        default=None,
        description="On a plan for a GPU: how many processes of this plan fit on one card "
        "(card_memory_bytes less the safety margin, over the predicted peak).",
    )


# -- profiles ----------------------------------------------------------------------------------


class TrialBase(Strict):
    micro_batch_size: Size
    fits: bool
    oom: bool = False
    peak_allocated_bytes: Bytes = 0
    peak_reserved_bytes: Bytes = 0
    step_seconds: float = Field(default=0.0, ge=0, le=1e9)
    error: LongText = ""
    warm_up: bool = False
    skipped_optimizer_step: bool = False
    repeat: bool = False
    estimated_peak_bytes: Bytes = 0


class MemoryModelBase(Strict):
    """Peak bytes of one step as ``fixed_bytes + bytes_per_sample * micro_batch_size``."""

    fixed_bytes: int = Field(ge=-MAX_BYTES, le=MAX_BYTES)
    bytes_per_sample: PositiveBytes


class ConditionsFields(Strict):
    """``autobatch.conditions.Conditions``: what moved the step's memory in the process it was
    measured in (allocator settings in effect, cuDNN flags, AMP, bytes by dtype, checkpointing,
    optimizer, data-parallel size); all empty when not recorded."""

    device_type: Name = ""
    allocator_settings: LongText = ""
    allocator_source: Name = ""
    allocator_backend: Name = ""
    allocator_environment: dict[Name, LongText] = Field(default_factory=dict, max_length=16)
    cuda_initialized: bool = False
    cudnn: dict[Name, Name] = Field(default_factory=dict, max_length=16)
    amp_dtype: Name = ""
    parameter_bytes: dict[Name, Bytes] = Field(default_factory=dict, max_length=64)
    gradient_bytes: dict[Name, Bytes] = Field(default_factory=dict, max_length=64)
    optimizer_state_bytes: dict[Name, Bytes] = Field(default_factory=dict, max_length=64)
    num_parameters: Annotated[int, Field(ge=0, le=MAX_BYTES)] = 0
    num_trainable_parameters: Annotated[int, Field(ge=0, le=MAX_BYTES)] = 0
    activation_checkpointing: LongText = ""
    optimizer: Name = ""
    optimizer_state_dtype: Name = ""
    world_size: Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE)] = 0
    world_size_source: LongText = ""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Conditions stored or sent under a key's earlier name (``RENAMED_KEYS``) read as
        the field that holds them now, as the library's ``Conditions.from_dict`` reads them."""
        if isinstance(data, dict):
            return {RENAMED_KEYS.get(name, name): value for name, value in data.items()}
        return data


class GradientSyncFields(Strict):
    """``autobatch.profile.GradientSync``: the gradient-sync mode a profile was measured in."""

    mode: SyncMode = ""
    wrapper: Name = ""
    num_micro_steps: int = Field(default=1, ge=1, le=1000)


Seconds = Annotated[float, Field(ge=0, le=1e9)]


class ProbeTimingsFields(Strict):
    """``autobatch.profile.ProbeTimings``: where a probe's time went, in seconds."""

    total_seconds: Seconds
    estimate_seconds: Seconds = 0.0
    fake_step_seconds: list[Seconds] = Field(default_factory=list, max_length=10000)
    trial_seconds: list[Seconds] = Field(default_factory=list, max_length=10000)
    cleanup_seconds: list[Seconds] = Field(default_factory=list, max_length=10000)
    clock: Clock = "wall"


class ProfileBase(Strict):
    """A probe result (``autobatch.Profile.to_dict()``)."""

    max_micro_batch_size: Size
    recommended_micro_batch_size: Size
    safety_margin: SafetyMargin
    method: Method
    trials: list[TrialBase] = Field(max_length=10000)
    num_steps: Count
    device_name: Name
    device_type: Name
    total_memory_bytes: Bytes
    capacity_bytes: Bytes
    foreign_memory_bytes: Bytes = 0
    memory_model: MemoryModelBase | None = None
    stop_kind: StopKind | None = Field(
        default=None,
        description="Why the search stopped: the next size did not fit, the limit was reached, "
        "or a non-OOM failure (schema version 1 profiles leave it out; it is then derived).",
    )
    stop_reason: LongText = ""
    notes: list[LongText] = Field(default_factory=list, max_length=1000)
    torch_version: Name = ""
    driver_version: Name = ""
    dtype: Name = ""
    amp_dtype: Name = ""
    optimizer: Name = ""
    input_shape: dict[Name, list[Annotated[int, Field(ge=0, le=MAX_SIZE)]]] = Field(
        default_factory=dict, max_length=1000
    )
    input_dtypes: dict[Name, Name] = Field(default_factory=dict, max_length=1000)
    model_fingerprint: Name = ""
    step_fingerprint: Name = ""
    failed_micro_batch_size: Count = 0
    mode: Mode = "train"
    compiled: Compiled = ""
    backend_flags: dict[Name, LongText] = Field(default_factory=dict, max_length=1000)
    created_at: Name = ""
    schema_version: int = Field(default=PROFILE_SCHEMA_VERSION, ge=1, le=PROFILE_SCHEMA_VERSION)
    budget: MemoryBudgetBase | None = Field(
        default=None, description="The memory budget the probe ran under (left out: not said)."
    )
    conditions: ConditionsFields | None = None
    gradient_sync: GradientSyncFields | None = None
    node_name: Name = Field(
        default="",
        description="The machine the profile was measured on (a Kubernetes or Slurm node, or "
        "the host name); device_name is the card type. Empty when not recorded.",
    )
    model_name: Name = Field(
        default="",
        description="How listings name the model ('gpt2', 'GPT2LMHeadModel'); "
        "model_fingerprint identifies it. Empty when not recorded (before schema version 4).",
    )
    activation_checkpointing: CheckpointingMode = Field(
        default="none",
        description="The activation checkpointing mode autobatch applied while measuring "
        "('none': the model as given; profiles that leave it out read as 'none').",
    )
    timings: ProbeTimingsFields | None = Field(
        default=None,
        description="Where the probe's time went: the estimate, each real trial, each clean-up "
        "after a failure (left out: not recorded).",
    )


class ProfileCreate(ProfileBase):
    """A profile to register, e.g. from ``autobatch.autotune`` on a training node."""


StoredProfile = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "allOf": [{"$ref": "#/components/schemas/ProfileCreate"}],
            "description": "The profile as the store holds it (autobatch.Profile.to_dict()): "
            "the fields of ProfileCreate. A profile a library stored directly (autobatch tune, "
            "a shared store) is listed as it is, past the bounds a request is held to (a note "
            "longer than 4096 characters, say).",
        }
    ),
]
"""A stored profile in an answer: whatever the library stored, never checked against the bounds
of a request (what the library can store, the service lists; a bound checked here would make a
profile that the library kept unreadable through the service: a 500)."""


StoredTrial = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "allOf": [{"$ref": "#/components/schemas/TrialBase"}],
            "description": "A trial as the probe reported it (autobatch.profile.Trial), its "
            "error as long as the probe's.",
        }
    ),
]
"""A trial in an answer, unchecked against a request's bounds (as :data:`StoredProfile`)."""


class ProfilePublic(BaseModel):
    id: str
    profile: StoredProfile


class ProfileList(BaseModel):
    profiles: list[ProfilePublic]
    next_before: str | None = None
    """Pass as ``before=`` for the next page; None when this page is the last."""
    next_after: str | None = None
    """When asked ``after=`` a cursor: the cursor to ask with next (the same one when nothing
    was stored since); None otherwise."""


class ProfileSummaryPublic(BaseModel):
    """What a listing shows of a stored profile; the whole profile is ``GET /v1/profiles/{id}``."""

    id: str  # GET /v1/profiles/{id} takes it
    cache_key: dict[str, Any]  # what an equal request matches: step, card, conditions
    model_fingerprint: str  # POST /v1/plan's model_fingerprint
    device_name: str  # the card it was measured on ("sim" for a simulated one)
    node_name: str  # empty when the profile names none
    model_name: str = ""  # empty: the profile names no model (before profile schema 4)
    max_micro_batch_size: int  # the measured maximum: the largest micro-batch that ran
    recommended_micro_batch_size: int  # that less the safety margin: what a plan plans within
    created_at: str  # when it was measured, ISO 8601 in UTC


class ProfileSummaryList(BaseModel):
    summaries: list[ProfileSummaryPublic]
    next_before: str | None = None
    """Pass as ``before=`` for the next page; None when this page is the last."""
    num_skipped: int = 0
    """Stored rows on this page that could not be read (logged by the server)."""


# -- plans -------------------------------------------------------------------------------------
