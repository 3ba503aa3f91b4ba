"""The result of a probe or an estimate: a self-describing, serialisable Profile.

Pure data: imports neither torch nor pynvml, so stores, the planner and the service can read
profiles on machines without either.

Example::

    profile = autobatch.probe(model, sample, device="sim:2GiB")
    profile.max_micro_batch_size          # e.g. 37
    Profile.from_dict(profile.to_dict()) == profile   # True
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from autobatch.conditions import Conditions
from autobatch.device import MemoryBudget
from autobatch.errors import ConfigError
from autobatch.margin import check_safety_margin
from autobatch.timings import Clock, ProbeTimings

if TYPE_CHECKING:
    from autobatch.device import MemoryBudget

__all__ = [
    "CONFIRMATION_STOP_REASON",
    "PROFILE_SCHEMA_VERSION",
    "CheckpointingMode",
    "Clock",
    "Compiled",
    "GradientSync",
    "MemoryModel",
    "Method",
    "Mode",
    "ProbeTimings",
    "Profile",
    "StepIdentity",
    "StopKind",
    "SyncMode",
    "Trial",
]

PROFILE_SCHEMA_VERSION = 4
"""Bumped whenever a field of :class:`Profile` is added, changes meaning or is removed (older
autobatch versions then skip such profiles in a shared store). Version 2 added ``stop_kind``;
version 3 added the blocks that say where and under what a profile holds: ``budget``,
``conditions``, ``gradient_sync`` and ``node_name``, and the probe's wall time by part,
``timings``; version 4 added ``model_name``. Versions 1 to 3 are still read (a missing
block reads as "not recorded"; a version 1 ``stop_kind`` is derived from ``stop_reason``)."""

CONFIRMATION_STOP_REASON = "confirmation: "
"""How the ``stop_reason`` of a profile confirming on arrival begins: one real trial at a
micro-batch predicted from another card's profile (:mod:`autobatch.tuning._confirmation`)."""

Method = Literal["estimate", "probe", "doubling"]
StopKind = Literal["boundary", "limit", "failure"]
"""Why a search stopped: ``"boundary"`` the next size did not fit; ``"limit"`` it reached
``max_micro_batch_size``; ``"failure"`` a non-OOM failure cut it short."""
Compiled = Literal["", "measured", "confirmed"]
Mode = Literal["train", "eval"]
CheckpointingMode = Literal["none", "selective", "full"]
"""Which repeated blocks recompute their activations in backward: none (the model as given),
every n-th (``"selective"``), every one (``"full"``); see
:mod:`autobatch.probing._checkpointing`."""
SyncMode = Literal["", "none", "once_per_window"]
"""How the measured step reduced gradients across data-parallel ranks; see :class:`GradientSync`."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """One training step tried at one micro-batch size."""

    micro_batch_size: int
    """Samples in the micro-batch (per device, per forward pass)."""
    fits: bool
    """True when the step completed within the capacity."""
    oom: bool = False
    """True when the step ran out of memory (the allocator raised)."""
    peak_allocated_bytes: int = 0
    """Peak bytes held by live tensors during the step (0 when it failed before measuring)."""
    peak_reserved_bytes: int = 0
    """Peak bytes the allocator took from the device (CUDA caching allocator); equals
    ``peak_allocated_bytes`` on devices without a cache."""
    step_seconds: float = 0.0
    """Wall time of the step in seconds (0 for an estimate)."""
    error: str = ""
    """Why the step did not fit or failed; empty when it fits."""
    warm_up: bool = False
    """True for the step that created the optimizer state; its peak lacks that state, so the
    search does not use it."""
    skipped_optimizer_step: bool = False
    """True when the step completed without ``optimizer.step()`` (a ``train_step`` with
    ``step_includes_update=True`` that accumulates gradients over several calls): its peak lacks
    the update's temporaries. The warm-up always ends with an optimizer step, so the optimizer
    state was present."""
    repeat: bool = False
    """True for the second step at the size the search chose: the first steps of a run differ
    (cuDNN benchmarking workspaces, allocator warm-up), so that size fits only if both steps did,
    and its peak is the larger of the two."""
    estimated_peak_bytes: int = 0
    """The estimate's predicted peak at this size (fake tensors, no workspaces), beside the
    measured ``peak_allocated_bytes``; 0 when there was no estimate or nothing was measured."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(f"trial micro_batch_size {self.micro_batch_size} must be >= 1")

    @property
    def estimate_error(self) -> float | None:
        """``(estimated - measured) / measured`` peak bytes (0.3: the estimate said 30% more);
        None without both."""
        if self.estimated_peak_bytes <= 0 or self.peak_allocated_bytes <= 0:
            return None
        return (self.estimated_peak_bytes - self.peak_allocated_bytes) / self.peak_allocated_bytes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Peak bytes of one step as ``fixed_bytes + bytes_per_sample * micro_batch_size``.

    Fitted where activations dominate (the largest fitting sizes), so it is a good predictor near
    and above them; below, the optimizer-step peak may dominate. See docs/how-it-works.md, "The
    probe".
    """

    fixed_bytes: int
    """Bytes independent of the micro-batch: weights, gradients, optimizer state, workspaces."""
    bytes_per_sample: int
    """Marginal bytes per sample (activations kept for backward), > 0."""

    def __post_init__(self) -> None:
        if self.bytes_per_sample <= 0:
            raise ConfigError(f"bytes_per_sample {self.bytes_per_sample} must be > 0")

    def peak_bytes(self, micro_batch_size: int) -> int:
        """Predicted peak bytes at ``micro_batch_size``."""
        return self.fixed_bytes + self.bytes_per_sample * micro_batch_size

    def max_micro_batch_size(self, capacity_bytes: int) -> int:
        """Largest micro-batch whose predicted peak is at most ``capacity_bytes``; 0 if none."""
        return max(0, (capacity_bytes - self.fixed_bytes) // self.bytes_per_sample)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepIdentity:
    """Everything about a training step, apart from the device, that changes its peak memory;
    with the device's name and total memory it makes a profile's cache key (:meth:`cache_key`).

    Built once per request by :func:`autobatch.probing._identity.step_identity` (the probe, the
    estimate
    and ``autotune`` all call it) and kept on the :class:`Profile`. Empty strings mean unknown
    (a profile built from numbers alone).
    """

    model_fingerprint: str = ""
    """Hash of the model's class, parameter/buffer names, shapes and dtypes."""
    step_fingerprint: str = ""
    """Hash of how the step is formed: the loss function or train step (name and code), the
    optimizer's hyperparameters and parameter groups, and the code of each module's forward."""
    input_shape: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Shape of one sample per input tensor (batch dimension removed), keyed by path."""
    input_dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Dtype of each input tensor, keyed like ``input_shape``."""
    dtype: str = ""
    """Dtype of the model's floating-point parameters, e.g. ``"float32"``."""
    amp_dtype: str = ""
    """Autocast dtype, empty when AMP is off."""
    optimizer: str = ""
    """Optimizer class name, e.g. ``"AdamW"``."""
    torch_version: str = ""
    backend_flags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Profiles written before :attr:`Profile.conditions` existed: the cuDNN flags and the raw
    ``PYTORCH_CUDA_ALLOC_CONF`` string. Empty in newer profiles, which record what is in effect
    in their conditions instead."""

    def cache_key(
        self,
        *,
        device_name: str,
        total_memory_bytes: int,
        compiled: str = "",
        mode: Mode = "train",
        conditions: Conditions | None = None,
        checkpointing: str = "none",
    ) -> str:
        """Canonical JSON of this identity and the device, as a string key (see
        ``autobatch.store._store``): equal keys, equal steps on equal cards. ``compiled`` (see
        :attr:`Profile.compiled`) joins the key only when set: a compiled step's peak differs
        from the eager one's, and uncompiled steps keep the keys they had. ``mode`` (see
        :attr:`Profile.mode`) likewise joins it only for ``"eval"``: an evaluation profile never
        answers for training. ``conditions`` (see :attr:`Profile.conditions`) join it when
        recorded (:meth:`Conditions.key`): a stored profile never answers across a change of a
        condition that moves memory. ``checkpointing`` (an activation checkpointing mode) joins
        it only when not ``"none"`` and no conditions are recorded (recorded ones hold what
        recomputes): a profile measured under one mode never stands for another."""
        known = conditions.key() if conditions is not None else {}
        if known:
            checkpointing = "none"
        return json.dumps(
            {
                **({"compiled": compiled} if compiled else {}),
                **({"checkpointing": checkpointing} if checkpointing != "none" else {}),
                **({"mode": mode} if mode != "train" else {}),
                **({"conditions": known} if known else {}),
                "model": self.model_fingerprint,
                "step": self.step_fingerprint,
                "input": {k: list(v) for k, v in sorted(self.input_shape.items())},
                "input_dtypes": dict(sorted(self.input_dtypes.items())),
                "dtype": self.dtype,
                "amp": self.amp_dtype,
                "optimizer": self.optimizer,
                "device": device_name,
                "total": total_memory_bytes,
                "torch": self.torch_version,
                "flags": dict(sorted(self.backend_flags.items())),
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists); its keys sit at a profile's top level."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "step_fingerprint": self.step_fingerprint,
            "input_shape": {k: list(v) for k, v in self.input_shape.items()},
            "input_dtypes": dict(self.input_dtypes),
            "dtype": self.dtype,
            "amp_dtype": self.amp_dtype,
            "optimizer": self.optimizer,
            "torch_version": self.torch_version,
            "backend_flags": dict(self.backend_flags),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepIdentity:
        """The identity's keys of ``data`` (a profile's dict); missing ones are empty."""
        return cls(
            model_fingerprint=str(data.get("model_fingerprint", "")),
            step_fingerprint=str(data.get("step_fingerprint", "")),
            input_shape={
                str(k): tuple(int(d) for d in v) for k, v in data.get("input_shape", {}).items()
            },
            input_dtypes={str(k): str(v) for k, v in data.get("input_dtypes", {}).items()},
            dtype=str(data.get("dtype", "")),
            amp_dtype=str(data.get("amp_dtype", "")),
            optimizer=str(data.get("optimizer", "")),
            torch_version=str(data.get("torch_version", "")),
            backend_flags={str(k): str(v) for k, v in data.get("backend_flags", {}).items()},
        )


_IDENTITY_KEYS = frozenset(f.name for f in dataclasses.fields(StepIdentity))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GradientSync:
    """The gradient-sync mode a profile (and a plan made from it) was measured in. It moves
    memory: a loop that skips the gradient reduction on the micro-steps before a window's last
    (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``, as the Accumulator
    does) holds those micro-steps' gradients between them, and under FSDP2 unsharded, the whole
    model's, where a step that reduces holds only its shard. The Accumulator refuses a plan
    measured in another mode than its loop runs (``Accumulator(plan=...)``)."""

    mode: SyncMode = ""
    """``""``: not recorded (a profile written before this field, an estimate, a plan from a
    number); ``"none"``: the step reduced no gradients across ranks (no DDP or FSDP2 wrapper, an
    evaluation, or a ``train_step`` that updates by itself, measured as it runs);
    ``"once_per_window"``: each trial ran ``num_micro_steps`` micro-steps, all but the last with
    the reduction skipped, then the optimizer step, as the Accumulator runs a window."""
    wrapper: str = ""
    """The data-parallel wrapper that reduced the gradients (``"DistributedDataParallel"``,
    ``"FSDP2 (fully_shard)"``), ``""`` for none."""
    num_micro_steps: int = 1
    """Forward and backward passes per measured trial, >= 1."""

    def __post_init__(self) -> None:
        if self.mode not in ("", "none", "once_per_window"):
            raise ConfigError(
                f"gradient_sync mode {self.mode!r} must be '', 'none' or 'once_per_window'"
            )
        if isinstance(self.num_micro_steps, bool) or not (
            isinstance(self.num_micro_steps, int) and self.num_micro_steps >= 1
        ):
            raise ConfigError(
                f"gradient_sync num_micro_steps {self.num_micro_steps!r} must be >= 1"
            )

    def describe(self) -> str:
        """In words, for messages: ``"with 2 micro-steps per trial, the gradient reduction of
        FSDP2 (fully_shard) skipped on all but the last"``."""
        if self.mode == "once_per_window":
            return (
                f"with {self.num_micro_steps} micro-steps per trial, the gradient reduction of "
                f"{self.wrapper} skipped on all but the last"
            )
        if self.mode == "none":
            return "with no gradient reduction across ranks"
        return "without a recorded gradient-sync mode (one micro-step per trial)"

    def answers(self, wanted: GradientSync) -> bool:
        """Whether a profile measured in this mode answers a request measured in ``wanted``:
        the same mode; or a profile from before modes were recorded (one micro-step) for a step
        that reduces nothing across ranks, which is what such a profile measured."""
        return self == wanted or (self.mode == "" and wanted.mode == "none")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "wrapper": self.wrapper, "num_micro_steps": self.num_micro_steps}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> GradientSync:
        """Inverse of :meth:`to_dict`; None or missing keys (older data) read as not recorded."""
        if data is None:
            return cls()
        return cls(
            mode=data.get("mode", ""),
            wrapper=str(data.get("wrapper", "")),
            num_micro_steps=data.get("num_micro_steps", 1),
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """What one probe (or estimate) found for one model, input, optimizer and device.

    ``max_micro_batch_size`` is the largest size whose whole training step fitted;
    ``recommended_micro_batch_size`` the largest whose peak stays under
    ``capacity_bytes * (1 - safety_margin)``.
    """

    max_micro_batch_size: int
    """Largest micro-batch that fitted (per device), >= 1."""
    recommended_micro_batch_size: int
    """Largest micro-batch that keeps ``safety_margin`` of the capacity free, 1..max."""
    safety_margin: float
    """Fraction of ``capacity_bytes`` kept free for the recommendation (0 <= x < 1)."""
    method: Method
    """``"estimate"`` (fake tensors, nothing allocated), ``"probe"`` (estimate, then real trials)
    or ``"doubling"`` (real trials without an estimate)."""
    trials: tuple[Trial, ...]
    """Every size tried, in order."""
    num_steps: int
    """Training steps run (trials plus warm-up steps); for an estimate, fake steps traced."""
    device_name: str
    """E.g. ``"NVIDIA H200"``, ``"cpu"``, ``"sim"``."""
    device_type: str
    """``"cuda"``, ``"cpu"`` or ``"sim"``."""
    total_memory_bytes: int
    """The device's total memory."""
    capacity_bytes: int
    """Bytes this process could use when probed (free + already reserved by torch)."""
    foreign_memory_bytes: int = 0
    """Bytes held by other processes on the device at probe time (NVML), 0 when unknown."""
    memory_model: MemoryModel | None = None
    """Linear fit of peak bytes near the answer; None when fewer than two sizes fitted."""
    stop_kind: StopKind = "boundary"
    """Why the search stopped, for code (the cache-reuse rule reads it); ``"failure"`` exactly
    when ``failed_micro_batch_size`` is set."""
    stop_reason: str = ""
    """The same, in words for display (e.g. ``"micro-batch 41 does not fit"``)."""
    notes: tuple[str, ...] = ()
    """Things the user should know (e.g. "estimate unavailable: ...; used doubling")."""
    driver_version: str = ""
    identity: StepIdentity = dataclasses.field(default_factory=StepIdentity)
    """The step this profile measured (model, inputs, dtypes, optimizer, torch, backend): with
    the device, the cache key. Serialised flat, at the profile's top level."""
    failed_micro_batch_size: int = 0
    """The smallest size that failed for a reason other than memory (its trial holds the error),
    taken as an upper bound: ``max_micro_batch_size`` is the largest size below it that ran; 0
    when none failed so. Such a profile is not cached (the failure may have been transient)."""
    mode: Mode = "train"
    """The step measured: ``"train"`` (forward, loss, backward, optimizer step) or ``"eval"``
    (forward, and the loss when the step's form gives one, under ``torch.inference_mode`` with
    the model in eval mode: the evaluation micro-batch)."""
    compiled: Compiled = ""
    """Whether the step was torch.compile'd: ``""`` no; ``"measured"`` every trial ran the
    compiled step (CUDA: memory read from allocator statistics); ``"confirmed"`` the trials ran it
    eagerly (memory counted with a dispatch mode, which Dynamo cannot run under) and one compiled
    step at the recommended size ran afterwards, its peak not measured."""
    created_at: str = ""
    """ISO-8601 UTC time of the probe."""
    schema_version: int = PROFILE_SCHEMA_VERSION
    budget: MemoryBudget | None = None
    """The memory budget the probe ran under: every source it read (NVML, the CUDA runtime,
    vGPU limits, fractions, the cgroup), the one that decided ``capacity_bytes`` and the sharing
    mode (:mod:`autobatch.device._budget`); None for a profile that does not say (an estimate,
    one written before autobatch recorded it)."""
    conditions: Conditions = dataclasses.field(default_factory=Conditions)
    """What moved the step's memory in the process it was measured in (allocator, dtypes and
    bytes, checkpointing, optimizer, cuDNN, AMP, data-parallel size), read from that process;
    compared with the live process wherever the profile is used (:mod:`autobatch.conditions`).
    Empty for a profile written before autobatch recorded them."""
    gradient_sync: GradientSync = dataclasses.field(default_factory=GradientSync)
    """The gradient-sync mode the trials ran in (not recorded in profiles written before it)."""
    node_name: str = ""
    """The machine the profile was measured on (:func:`autobatch.device._node.node_name`: a
    Kubernetes node, a Slurm node or the host name); ``""`` for an estimate or a profile written
    before schema version 3. ``device_name`` is the card type."""
    model_name: str = ""
    """How listings name the model: the name the command line was given (``gpt2``), else the
    model's class (``GPT2LMHeadModel``); ``""`` before schema version 4 (listed by
    ``model_fingerprint``)."""
    activation_checkpointing: CheckpointingMode = "none"
    """The activation checkpointing mode autobatch applied while measuring: ``"none"`` (the model
    as given, and every profile written before autobatch recorded it), ``"selective"`` or
    ``"full"`` (:mod:`autobatch.probing._checkpointing`). The conditions' description of what
    recomputed is part of the cache key, so a profile of one mode never answers for another."""
    timings: ProbeTimings | None = None
    """Where the probe's time went (estimate, each real trial, each clean-up); None for an
    estimate or a profile written before autobatch recorded it."""

    def __post_init__(self) -> None:
        if self.max_micro_batch_size < 1:
            raise ConfigError(f"max_micro_batch_size {self.max_micro_batch_size} must be >= 1")
        if not 1 <= self.recommended_micro_batch_size <= self.max_micro_batch_size:
            raise ConfigError(
                f"recommended_micro_batch_size {self.recommended_micro_batch_size} must be in "
                f"1..{self.max_micro_batch_size}"
            )
        check_safety_margin(self.safety_margin)
        if (self.stop_kind == "failure") != (self.failed_micro_batch_size > 0):
            raise ConfigError(
                f"stop_kind {self.stop_kind!r} disagrees with failed_micro_batch_size "
                f"{self.failed_micro_batch_size}: a search stops by failure exactly when a size "
                "failed for a reason other than memory"
            )
        if not 0 <= self.capacity_bytes <= self.total_memory_bytes:
            raise ConfigError(
                f"capacity_bytes {self.capacity_bytes} must be in 0..total_memory_bytes "
                f"{self.total_memory_bytes}: the usable capacity is part of the device's memory"
            )

    @property
    def num_trials(self) -> int:
        """Real (or fake, for an estimate) sizes tried."""
        return len(self.trials)

    @property
    def num_ooms(self) -> int:
        """Trials that ran out of memory."""
        return sum(trial.oom for trial in self.trials)

    @property
    def confirms_prediction(self) -> bool:
        """True when ``max_micro_batch_size`` was predicted from another card's profile and
        confirmed by one real trial here, not searched to this card's memory edge."""
        return self.stop_reason.startswith(CONFIRMATION_STOP_REASON)

    # Read-only shorthands for the identity's fields (the public attributes of schema 1).

    @property
    def model_fingerprint(self) -> str:
        """``identity.model_fingerprint``."""
        return self.identity.model_fingerprint

    @property
    def step_fingerprint(self) -> str:
        """``identity.step_fingerprint``."""
        return self.identity.step_fingerprint

    @property
    def input_shape(self) -> Mapping[str, tuple[int, ...]]:
        """``identity.input_shape``."""
        return self.identity.input_shape

    @property
    def input_dtypes(self) -> Mapping[str, str]:
        """``identity.input_dtypes``."""
        return self.identity.input_dtypes

    @property
    def dtype(self) -> str:
        """``identity.dtype``."""
        return self.identity.dtype

    @property
    def amp_dtype(self) -> str:
        """``identity.amp_dtype``."""
        return self.identity.amp_dtype

    @property
    def optimizer(self) -> str:
        """``identity.optimizer``."""
        return self.identity.optimizer

    @property
    def torch_version(self) -> str:
        """``identity.torch_version``."""
        return self.identity.torch_version

    @property
    def backend_flags(self) -> Mapping[str, str]:
        """``identity.backend_flags``."""
        return self.identity.backend_flags

    @property
    def failure_note(self) -> str:
        """In plain words, the failure other than memory that bounded the search; "" if none."""
        if not self.failed_micro_batch_size:
            return ""
        error = next(
            (t.error for t in self.trials if t.micro_batch_size == self.failed_micro_batch_size),
            "",
        )
        return (
            f"micro-batch {self.failed_micro_batch_size} failed for a reason other than memory "
            f"({error or 'no message'}), so it was taken as an upper bound: the largest "
            f"micro-batch that ran is {self.max_micro_batch_size}. Larger sizes may fail the same "
            "way in training (a kernel's launch limit, say); the profile is not cached"
        )

    def cache_key(self) -> str:
        """Key under which an equal request may reuse this profile (see
        :mod:`autobatch.store._store`)."""
        return self.identity.cache_key(
            device_name=self.device_name,
            total_memory_bytes=self.total_memory_bytes,
            compiled=self.compiled,
            mode=self.mode,
            conditions=self.conditions,
            checkpointing=self.activation_checkpointing,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists); the identity's fields at the top level."""
        data = dataclasses.asdict(self)
        del data["identity"]
        data.update(self.identity.to_dict())
        if self.budget is None:  # left out: profiles without one read as they always did
            del data["budget"]
        else:
            data["budget"] = self.budget.to_dict()
        data["conditions"] = self.conditions.to_dict()
        if self.timings is None:
            del data["timings"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Inverse of :meth:`to_dict`; also reads schema version 1 (without ``stop_kind``).

        Raises:
            ConfigError: a field is missing or of the wrong kind, or the schema is newer than this
                version of autobatch reads.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"not a valid profile: expected an object, got {type(data).__name__}")
        version = data.get("schema_version", PROFILE_SCHEMA_VERSION)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ConfigError(f"not a valid profile: schema_version {version!r} is not an int")
        if version > PROFILE_SCHEMA_VERSION:
            raise ConfigError(
                f"profile schema_version {version!r} is newer than this autobatch reads "
                f"({PROFILE_SCHEMA_VERSION}); upgrade autobatch"
            )
        try:
            fields = {k: v for k, v in data.items() if k not in _IDENTITY_KEYS}
            fields["identity"] = StepIdentity.from_dict(data)
            fields["trials"] = tuple(Trial(**t) for t in data.get("trials", ()))
            model = data.get("memory_model")
            fields["memory_model"] = MemoryModel(**model) if model else None
            fields["notes"] = tuple(data.get("notes", ()))
            budget = data.get("budget")
            if budget is not None:
                fields["budget"] = MemoryBudget.from_dict(budget)
            fields["conditions"] = Conditions.from_dict(data.get("conditions"))
            fields["gradient_sync"] = GradientSync.from_dict(data.get("gradient_sync"))
            fields["timings"] = ProbeTimings.from_dict(data.get("timings"))
            if fields.get("stop_kind") is None:  # schema 1, or a service body that left it out
                fields["stop_kind"] = _stop_kind_of_v1(data)
            fields["schema_version"] = PROFILE_SCHEMA_VERSION
            return cls(**fields)
        except (TypeError, AttributeError, ValueError) as exc:
            raise ConfigError(f"not a valid profile: {exc}") from exc


def _stop_kind_of_v1(data: Mapping[str, Any]) -> StopKind:
    """The stop kind of a profile written before ``stop_kind`` existed, from what it recorded:
    a failed size, or the prose autobatch wrote when the limit was reached."""
    if data.get("failed_micro_batch_size"):
        return "failure"
    return "limit" if str(data.get("stop_reason", "")).startswith("limit") else "boundary"
