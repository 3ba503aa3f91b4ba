"""What a plan holds under: the conditions of the process a profile was measured in, and the one
comparison every user of a plan makes against the live process.

A step's peak memory moves with more than the model and its inputs (the step's identity, the
cache key's core): with the allocator settings in effect, the bytes and dtypes of parameters,
gradients and optimizer state, activation checkpointing, the optimizer, cuDNN's flags and AMP.
:class:`Conditions` records them, read from the live process by
:func:`autobatch.probing._live_conditions.read_conditions` (never from flags the user passed);
:func:`condition_changes` is the comparison the store lookup, ``autobatch.plan(profile)``, the
Accumulator and the framework drop-ins all make, and :func:`launcher_world_size` reads the
data-parallel size a launcher (torchrun) set before any process group exists.

Pure: imports neither torch nor pynvml.

Example::

    changes = condition_changes(profile.conditions, live)
    for change in changes:
        print(change.describe())   # "cudnn.benchmark: measured with True, this process has ..."
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from autobatch.errors import ConfigError
from autobatch.launchers import SlurmTaskRanks, launcher_layout
from autobatch.units import format_bytes

__all__ = [
    "ALLOCATOR_VARIABLES",
    "RENAMED_KEYS",
    "ConditionChange",
    "Conditions",
    "check_world_size",
    "condition_changes",
    "launcher_world_size",
    "normalized_allocator_settings",
    "one_world_size",
]

ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The allocator's environment variables: the newer name and the older one torch still reads
(torch 2.9 ignored the newer one on CUDA; torch 2.13 reads either, and with both set applied
``PYTORCH_CUDA_ALLOC_CONF`` here). Which one is in effect is read back, never assumed."""

RENAMED_KEYS = {"data_parallel_size": "world_size", "data_parallel_source": "world_size_source"}
"""Keys stored conditions may carry under another name -> the field that holds them: a profile
that has them loads (:meth:`Conditions.from_dict`, the service's ``ConditionsFields``), and
every profile is written under the fields' names."""

CUDA_ONLY = ("allocator_settings", "allocator_backend", "cudnn")
"""Conditions that move memory only on a CUDA device: the CPU allocator ignores the allocator
settings, and cuDNN does not run there (nor on a simulated card, which counts tensor bytes)."""


_Size = TypeVar("_Size")
"""A data-parallel size as an edge holds it: an int, or a list of them for a table."""


def _dict(value: Any) -> dict[str, Any]:
    return dict(value or {})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Conditions:
    """The conditions that move a step's memory, as the process had them when the step was
    measured (a Profile's, and a Plan's from it), or as the live process has them.

    Empty (the default) means not recorded: a profile written before autobatch recorded
    conditions, or a plan from a number. Within recorded conditions an empty string, mapping or
    0 means unknown (e.g. the optimizer state's dtype before the first optimizer step, AMP in a
    training loop that autocasts by itself); unknown values are never compared.
    """

    device_type: str = ""
    """The device type they were read for: ``"cuda"``, ``"cpu"``, ``"sim"`` (a simulated card on
    the CPU) or ``"fake"`` (an estimate); ``""`` when not recorded."""
    allocator_settings: str = ""
    """The CUDA caching allocator's settings in effect, as torch reports them
    (``torch._C._accelerator_getAllocatorSettings()``), normalised to sorted ``key:value`` entries
    (:func:`normalized_allocator_settings`); ``""`` is torch's defaults."""
    allocator_source: str = ""
    """Where ``allocator_settings`` came from: ``"torch"`` (read back from torch), or
    ``"environment"`` (a torch that cannot say: ``PYTORCH_CUDA_ALLOC_CONF`` as set); ``""``
    unknown (torch not loaded)."""
    allocator_backend: str = ""
    """``"native"`` or ``"cudaMallocAsync"`` (``torch.cuda.memory.get_allocator_backend()``);
    ``""`` on a torch without CUDA."""
    allocator_environment: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The variables of :data:`ALLOCATOR_VARIABLES` that are set, as set (both names)."""
    cuda_initialized: bool = False
    """Whether CUDA was initialised when they were read: settings set in the environment after
    torch read them are not in effect (see :attr:`ignored_allocator_variables`)."""
    cudnn: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """``torch.backends.cudnn``'s ``enabled``, ``benchmark`` and ``deterministic`` (as
    ``"True"``/``"False"``): the kernels and workspaces cuDNN picks; empty when unknown."""
    amp_dtype: str = ""
    """The autocast dtype: ``"bfloat16"``, ``"float16"``, or ``"off"``; ``""`` unknown."""
    parameter_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Bytes of the parameters resident on this device by dtype (``{"float32": 497664}``): of a
    sharded (FSDP2, DTensor) parameter its shard, padded to the largest rank's as FSDP2
    allocates it (the same on every rank)."""
    gradient_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Bytes of the gradients a backward makes by dtype: one per trainable parameter, in its
    dtype (as torch makes them)."""
    optimizer_state_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Bytes of the optimizer state by dtype (fp32 master copies included), as it was after the
    probe's first optimizer step; empty when no step had run."""
    num_parameters: int = 0
    """Parameter elements resident on this device."""
    num_trainable_parameters: int = 0
    """Of which ``requires_grad``."""
    activation_checkpointing: str = ""
    """What recomputes activations in backward, as detected: ``"none detected"``, or e.g.
    ``"Hugging Face gradient_checkpointing on 2 modules (torch.utils.checkpoint.checkpoint,
    use_reentrant=True)"``. A ``torch.utils.checkpoint.checkpoint`` call inside a forward cannot
    be seen without running it (the step's fingerprint covers the forward's code)."""
    optimizer: str = ""
    """The optimizer's class, module included (``"torch.optim.adamw.AdamW"``,
    ``"bitsandbytes.optim.adamw.PagedAdamW8bit"``)."""
    optimizer_state_dtype: str = ""
    """The dtype holding most of the optimizer state's bytes (``"uint8"`` for an 8-bit
    optimizer); ``""`` before the first optimizer step."""
    world_size: int = 0
    """Data-parallel ranks of the process (0 unknown); a plan's ``world_size`` is checked
    against the live process's."""
    world_size_source: str = ""
    """Where ``world_size`` came from, e.g. ``"the launcher's environment (WORLD_SIZE=2,
    RANK=0, LOCAL_RANK=0)"``, ``"the default process group"``, ``"argument world_size"``."""

    @property
    def recorded(self) -> bool:
        """Whether these conditions were read from a process (False: not recorded)."""
        return bool(self.device_type)

    @property
    def trainable_fraction(self) -> float | None:
        """Trainable parameter elements / all of them; None when unknown."""
        if not self.num_parameters:
            return None
        return self.num_trainable_parameters / self.num_parameters

    @property
    def ignored_allocator_variables(self) -> dict[str, str]:
        """Allocator variables set in the environment whose settings are not in effect (set
        after torch read its allocator settings, or a name this torch does not read on CUDA)."""
        if self.allocator_source != "torch":
            return {}
        in_effect = self.allocator_settings
        return {
            name: value
            for name, value in self.allocator_environment.items()
            if normalized_allocator_settings(value) != in_effect
        }

    def not_in_effect(self) -> list[str]:
        """Notes for the allocator variables set but not in effect, where they would apply."""
        if not self.applies("allocator_settings"):
            return []
        return [
            f"{name}={value!r} is set but not in effect ({_not_in_effect()}; torch runs "
            f"{self.allocator_settings or 'its defaults'}): set it before the process starts"
            for name, value in self.ignored_allocator_variables.items()
        ]

    def applies(self, name: str) -> bool:
        """Whether the condition ``name`` (a field) moves memory on :attr:`device_type`."""
        return name not in CUDA_ONLY or self.device_type == "cuda"

    def key(self) -> dict[str, Any]:
        """The conditions a profile's cache key holds: every one that moves memory on
        :attr:`device_type` and is known before any step runs (so a request's key equals the key
        its profile is stored under); empty when not recorded."""
        if not self.recorded:
            return {}
        known: dict[str, Any] = {
            "device_type": self.device_type,
            "amp_dtype": self.amp_dtype,
            "parameter_bytes": dict(sorted(self.parameter_bytes.items())),
            "gradient_bytes": dict(sorted(self.gradient_bytes.items())),
            "num_parameters": self.num_parameters,
            "num_trainable_parameters": self.num_trainable_parameters,
            "activation_checkpointing": self.activation_checkpointing,
            "optimizer": self.optimizer,
        }
        if self.device_type == "cuda":
            known["allocator_settings"] = self.allocator_settings
            known["allocator_backend"] = self.allocator_backend
            known["cudnn"] = dict(sorted(self.cudnn.items()))
        return known

    def describe(self) -> list[str]:
        """One line per condition, for display; what does not apply on the device says so."""
        if not self.recorded:
            return ["conditions: not recorded"]
        device = self.device_type
        lines = []
        if self.applies("allocator_settings"):
            settings = self.allocator_settings or "torch defaults"
            read = "read back from torch" if self.allocator_source == "torch" else "environment"
            lines.append(
                f"allocator: {settings} (backend {self.allocator_backend or 'unknown'}; {read})"
            )
            for name, value in self.ignored_allocator_variables.items():
                lines.append(f"  {name}={value!r} is set but not in effect ({_not_in_effect()})")
            lines.append(f"cuDNN: {_flags(self.cudnn) or 'unknown'}")
        else:
            lines.append(f"allocator settings and cuDNN flags: do not apply on {device}")
        lines.append(f"AMP: {self.amp_dtype or 'unknown'}")
        lines.append(f"parameters: {_by_dtype(self.parameter_bytes)}")
        lines.append(f"gradients: {_by_dtype(self.gradient_bytes)}")
        fraction = self.trainable_fraction
        if fraction is not None:
            lines.append(
                f"trainable: {self.num_trainable_parameters} of {self.num_parameters} parameter "
                f"elements ({fraction:.1%})"
            )
        lines.append(f"activation checkpointing: {self.activation_checkpointing or 'unknown'}")
        state = self.optimizer_state_dtype or "unknown until its first step"
        lines.append(f"optimizer: {self.optimizer or 'unknown'} (state {state})")
        if self.optimizer_state_bytes:
            lines.append(f"optimizer state: {_by_dtype(self.optimizer_state_bytes)}")
        if self.world_size:
            lines.append(f"data-parallel size: {self.world_size}, from {self.world_size_source}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        for name in (
            "allocator_environment",
            "cudnn",
            "parameter_bytes",
            "gradient_bytes",
            "optimizer_state_bytes",
        ):
            data[name] = dict(data[name])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Conditions:
        """Inverse of :meth:`to_dict`; None or ``{}`` (a profile written before conditions were
        recorded) gives empty conditions, and a key of :data:`RENAMED_KEYS` is read under its
        current name.

        Raises:
            ConfigError: an unknown field, or a value of the wrong kind.
        """
        if not data:
            return cls()
        data = {RENAMED_KEYS.get(name, name): value for name, value in data.items()}
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"not valid conditions: unknown fields {unknown}")
        try:
            fields = dict(data)
            for name in ("allocator_environment", "cudnn"):
                fields[name] = {str(k): str(v) for k, v in _dict(data.get(name)).items()}
            for name in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
                fields[name] = {str(k): int(v) for k, v in _dict(data.get(name)).items()}
            return cls(**fields)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"not valid conditions: {exc}") from exc


ChangeKind = Literal["memory", "batch"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConditionChange:
    """One condition that differs between where a plan was measured and the live process."""

    name: str
    """The condition, e.g. ``"cudnn.benchmark"``, ``"allocator settings"``, ``"world_size"``."""
    recorded: str
    """Its value where the plan was measured."""
    live: str
    """Its value in this process."""
    fix: str
    """How to make them agree (never a setting already in effect here)."""
    kind: ChangeKind = "memory"
    """``"memory"``: the step's peak may differ (a warning: it may run out of memory);
    ``"batch"``: the plan's effective batch would not be the one asked for (refused)."""

    def describe(self) -> str:
        """``"name: measured with X, this process has Y; fix"`` (``"the plan is for X"`` for a
        world size)."""
        where = "the plan is for" if self.kind == "batch" else "measured with"
        return f"{self.name}: {where} {self.recorded}, this process has {self.live}; {self.fix}"


def condition_changes(
    recorded: Conditions, live: Conditions, *, world_size: int | None = None
) -> tuple[ConditionChange, ...]:
    """What differs between the conditions a profile (or plan) was measured under and the live
    process's: the one comparison every user of a plan makes.

    Each condition is compared only where it moves memory on the device the profile measured
    (:attr:`Conditions.applies`) and only when both sides know it; nothing is compared when
    ``recorded`` is not recorded.

    Args:
        recorded: the profile's or the plan's conditions.
        live: the live process's (:func:`autobatch.probing._live_conditions.read_conditions`).
        world_size: a plan's data-parallel size, compared with ``live.world_size``
            (a ``"batch"`` change); None compares no world size (a profile has none).

    Returns:
        The changes, in a fixed order; empty when the plan holds here.
    """
    changes: list[ConditionChange] = []
    if world_size is not None and live.world_size and world_size != live.world_size:
        changes.append(
            ConditionChange(
                name="world_size",
                recorded=f"{world_size} data-parallel ranks",
                live=f"{live.world_size} (from {live.world_size_source})",
                fix=f"plan for world_size={live.world_size}, or the effective batch "
                f"would be {live.world_size}/{world_size} of the one planned",
                kind="batch",
            )
        )
    if not recorded.recorded:
        return tuple(changes)
    for compare in _COMPARISONS:
        changes.extend(compare(recorded, live))
    return tuple(changes)


def _allocator(recorded: Conditions, live: Conditions) -> list[ConditionChange]:
    if not recorded.applies("allocator_settings") or not (
        recorded.allocator_source and live.allocator_source
    ):
        return []
    changes = []
    if recorded.allocator_settings != live.allocator_settings:
        ignored = live.ignored_allocator_variables
        why = (
            "; ".join(
                f"{name}={value!r} is set but not in effect" for name, value in ignored.items()
            )
            + f" ({_not_in_effect()}); "
            if ignored
            else ""
        )
        wanted = recorded.allocator_settings
        fix = (
            f"start the process with PYTORCH_ALLOC_CONF={wanted} (before torch initialises CUDA)"
            if wanted
            else "start the process without PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF"
        )
        changes.append(
            ConditionChange(
                name="allocator settings in effect",
                recorded=repr(wanted or "torch defaults"),
                live=repr(live.allocator_settings or "torch defaults"),
                fix=f"{why}{fix}, or tune again in this process",
            )
        )
    if (
        recorded.allocator_backend
        and live.allocator_backend
        and recorded.allocator_backend != live.allocator_backend
    ):
        changes.append(
            ConditionChange(
                name="allocator backend",
                recorded=recorded.allocator_backend,
                live=live.allocator_backend,
                fix=f"start the process with PYTORCH_ALLOC_CONF=backend:"
                f"{recorded.allocator_backend}, or tune again in this process",
            )
        )
    return changes


def _cudnn(recorded: Conditions, live: Conditions) -> list[ConditionChange]:
    if not recorded.applies("cudnn"):
        return []
    return [
        ConditionChange(
            name=f"cudnn.{flag}",
            recorded=value,
            live=live.cudnn[flag],
            fix=f"set torch.backends.cudnn.{flag} = {value} before training, or tune again with "
            f"{live.cudnn[flag]}",
        )
        for flag, value in sorted(recorded.cudnn.items())
        if flag in live.cudnn and live.cudnn[flag] != value
    ]


def _amp(recorded: Conditions, live: Conditions) -> list[ConditionChange]:
    if not (recorded.amp_dtype and live.amp_dtype) or recorded.amp_dtype == live.amp_dtype:
        return []
    wanted = recorded.amp_dtype
    return [
        ConditionChange(
            name="amp_dtype",
            recorded=wanted,
            live=live.amp_dtype,
            fix=(
                "train without autocast, as measured"
                if wanted == "off"
                else f"autocast to torch.{wanted} as measured"
            )
            + f", or tune again with amp_dtype={_amp_argument(live.amp_dtype)}",
        )
    ]


def _amp_argument(amp_dtype: str) -> str:
    return "None" if amp_dtype == "off" else f"torch.{amp_dtype}"


def _bytes(recorded: Conditions, live: Conditions) -> list[ConditionChange]:
    changes = []
    for name, what in (
        ("parameter_bytes", "parameter bytes"),
        ("gradient_bytes", "gradient bytes"),
    ):
        mine, theirs = getattr(recorded, name), getattr(live, name)
        if mine and theirs and dict(mine) != dict(theirs):
            changes.append(
                ConditionChange(
                    name=what,
                    recorded=_by_dtype(mine),
                    live=_by_dtype(theirs),
                    fix="tune the model as it trains (the same dtypes, sharding and frozen "
                    "parameters: after .to(dtype), fully_shard, "
                    "from_pretrained(torch_dtype=...))",
                )
            )
    if (
        recorded.num_parameters
        and live.num_parameters
        and recorded.num_trainable_parameters != live.num_trainable_parameters
    ):
        changes.append(
            ConditionChange(
                name="trainable parameters",
                recorded=_trainable(recorded),
                live=_trainable(live),
                fix="freeze the same parameters (requires_grad) before tuning as in training",
            )
        )
    return changes


def _checkpointing(recorded: Conditions, live: Conditions) -> list[ConditionChange]:
    mine, theirs = recorded.activation_checkpointing, live.activation_checkpointing
    if not (mine and theirs) or mine == theirs:
        return []
    return [
        ConditionChange(
            name="activation checkpointing",
            recorded=mine,
            live=theirs,
            fix="tune with activation checkpointing set as it trains",
        )
    ]


def _optimizer(recorded: Conditions, live: Conditions) -> list[ConditionChange]:
    changes = []
    if recorded.optimizer and live.optimizer and recorded.optimizer != live.optimizer:
        changes.append(
            ConditionChange(
                name="optimizer",
                recorded=recorded.optimizer,
                live=live.optimizer,
                fix="pass the optimizer this loop steps to autotune(optimizer=...)",
            )
        )
    mine, theirs = recorded.optimizer_state_dtype, live.optimizer_state_dtype
    if mine and theirs and mine != theirs:
        changes.append(
            ConditionChange(
                name="optimizer state dtype",
                recorded=mine,
                live=theirs,
                fix="tune with the optimizer (and its state precision) this loop steps",
            )
        )
    return changes


_COMPARISONS = (_allocator, _cudnn, _amp, _bytes, _checkpointing, _optimizer)


def _not_in_effect() -> str:
    return (
        "torch read its allocator settings before it was set (they are read once, when torch "
        "loads or CUDA initialises), or this torch does not read that name on CUDA"
    )


def _flags(flags: Mapping[str, str]) -> str:
    return ", ".join(f"{name}={value}" for name, value in sorted(flags.items()))


def _by_dtype(by_dtype: Mapping[str, int]) -> str:
    if not by_dtype:
        return "unknown"
    return ", ".join(f"{format_bytes(n)} {dtype}" for dtype, n in sorted(by_dtype.items()))


def _trainable(conditions: Conditions) -> str:
    fraction = conditions.trainable_fraction or 0.0
    return (
        f"{conditions.num_trainable_parameters} of {conditions.num_parameters} trainable "
        f"({fraction:.1%})"
    )


def normalized_allocator_settings(text: str) -> str:
    """Allocator settings as sorted ``key:value`` entries without spaces, so that equal settings
    written differently compare equal: ``"max_split_size_mb:128, expandable_segments:True"`` is
    ``"expandable_segments:True,max_split_size_mb:128"``. Commas inside ``[...]`` stay."""
    entries: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text.replace(" ", ""):
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            entries.append("".join(current))
            current = []
        else:
            current.append(char)
    entries.append("".join(current))
    return ",".join(sorted(entry for entry in entries if entry))


def launcher_world_size(
    environ: Mapping[str, str], *, slurm_task_ranks: SlurmTaskRanks = "one"
) -> tuple[int, str] | None:
    """The data-parallel size a launcher set in the environment, and where it says so; None when
    no launcher did.

    Reads what each launcher sets (:func:`autobatch.launchers.launcher_layout`, listed in
    docs/launchers.md): torchrun's and ``accelerate launch``'s ``WORLD_SIZE`` with
    ``LOCAL_WORLD_SIZE``, the DeepSpeed launcher's, ``mpirun``'s, Kubeflow's ``PET_NNODES`` x
    ``PET_NPROC_PER_NODE`` (its ``WORLD_SIZE`` counts pods), a Slurm step's tasks (a batch
    script, before ``srun``, is one process), else a bare ``WORLD_SIZE``.

    Args:
        environ: the variables, e.g. ``os.environ``.
        slurm_task_ranks: ``"one"`` inside a task; ``"gpus"`` before a task's command runs, where
            each task will start one rank per GPU it holds (a TaskProlog).

    Raises:
        ConfigError: a variable is not a count, or two launchers' variables disagree (named,
            with the fix).
    """
    layout = launcher_layout(environ, slurm_task_ranks=slurm_task_ranks)
    return None if layout is None else (layout.world_size, layout.source)


def one_world_size(world_size: _Size | None, data_parallel_size: _Size | None) -> _Size | None:
    """The data-parallel size given at an edge under its name, ``world_size``, or under its
    accepted alias, ``data_parallel_size`` (``autotune``'s keyword, the CLI's
    ``--data-parallel-size``, ``POST /v1/plan``'s field): every edge reconciles the two here.

    Each is a size (or a list of sizes, for a table), None when not given.

    Returns:
        The one given, their common value when both are, None when neither is (the range is
        :func:`check_world_size`'s, where the size is used).

    Raises:
        ConfigError: both are given and differ.
    """
    both = world_size is not None and data_parallel_size is not None
    if both and world_size != data_parallel_size:
        raise ConfigError(
            f"world_size {world_size} and data_parallel_size {data_parallel_size} disagree on "
            "the number of data-parallel ranks; give one (they are one setting)"
        )
    return data_parallel_size if world_size is None else world_size


def check_world_size(value: object) -> int:
    """``value``, checked as a data-parallel size (``world_size``, an int >= 1): its one range
    check, for the planner's requests and the road's resolution alike.

    Raises:
        ConfigError: not an int (a bool included), or below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"world_size {value!r} must be an int >= 1 (data-parallel ranks)")
    return value
