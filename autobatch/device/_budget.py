"""The memory a job really has: every source the process can see, the smallest of them, and how
the device is shared.

PURE apart from reading environment variables handed in as a mapping: no torch, no pynvml. The
devices (:mod:`autobatch.device._cuda`, ``cpu``, ``simulated``) and the service read their sources
at the boundary and hand the readings to :func:`combine_budget`, the one rule:

- the budget is the smallest ``available_bytes`` of any reading (the deciding source, the first
  in reading order on a tie);
- a reading whose ``total_bytes`` is more than :data:`SHARING_TOLERANCE` (5%) below the largest
  total (the whole device) shows a sharing layer: a CUDA runtime or vGPU limit smaller than the
  card is ``virtualised``, a per-process or declared fraction ``fractional``, device-plugin
  replicas ``time_sliced``, an MPS client's limit ``mps``, a cgroup limit below the host
  ``container_limited``;
- a GPU reading whose free memory is more than 5% below its total shows other processes on it:
  ``shared``;
- the sharing mode is the deciding source's, else the first one seen, else ``"none"``; each one
  seen adds a warning.

Sources, in the order the devices read them (``docs/devices.md``): a GPU's ``nvml``,
``cuda_runtime``, ``vgpu_limit``, ``mps_limit``, ``memory_fraction``, ``gpu_fraction``; the
CPU's ``host``, ``cgroup``; a simulated card's ``simulated``, ``gpu_fraction``; the service's
``nvml``, ``node_labels`` or ``capacity_bytes``, then ``time_slicing`` (``mps_limit`` under the
device plugin's MPS strategy), ``vgpu_limit``, ``mps_limit``, ``gpu_fraction``; ``ranks`` when
ranks agree on the smallest rank's capacity.

Example::

    budget = combine_budget([
        BudgetReading(source="nvml", total_bytes=10 * GiB, available_bytes=10 * GiB),
        BudgetReading(source="cuda_runtime", total_bytes=3 * GiB, available_bytes=3 * GiB),
    ])
    budget.budget_bytes, budget.deciding_source, budget.sharing_mode
    # (3221225472, 'cuda_runtime', 'virtualised')
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from autobatch.errors import ConfigError
from autobatch.units import format_bytes

__all__ = [
    "MAX_GPU_FRACTION",
    "MIN_GPU_FRACTION",
    "SHARING_TOLERANCE",
    "BudgetReading",
    "BudgetSource",
    "MemoryBudget",
    "SharingMode",
    "check_gpu_fraction",
    "combine_budget",
    "fraction_reading",
    "gpu_fraction_reading",
    "parse_memory_limit",
    "vgpu_limit_reading",
]

BudgetSource = Literal[
    "nvml",
    "cuda_runtime",
    "vgpu_limit",
    "mps_limit",
    "memory_fraction",
    "gpu_fraction",
    "host",
    "cgroup",
    "simulated",
    "capacity_bytes",
    "node_labels",
    "time_slicing",
    "ranks",
]
"""Where a :class:`BudgetReading` came from (see the module docstring for each)."""
SOURCES: tuple[BudgetSource, ...] = BudgetSource.__args__  # type: ignore[attr-defined]

SharingMode = Literal[
    "none", "shared", "virtualised", "fractional", "time_sliced", "container_limited", "mps"
]
"""How the device is shared, as the readings show it; ``"none"`` when they agree."""
SHARING_MODES: tuple[SharingMode, ...] = SharingMode.__args__  # type: ignore[attr-defined]

MIN_GPU_FRACTION = 0.0
"""A declared ``gpu_fraction`` is above this (exclusive): a share of no memory plans nothing."""
MAX_GPU_FRACTION = 1.0
"""A declared ``gpu_fraction`` is at most this (inclusive): the whole card."""

SHARING_TOLERANCE = 0.05
"""Readings may disagree by this fraction of the device's total before a sharing mode is set
(a CUDA context, a driver's reserve and rounding stay under it on cards of 16 GB and more)."""

_LIMIT_MODES: dict[str, SharingMode] = {
    "cuda_runtime": "virtualised",
    "vgpu_limit": "virtualised",
    "mps_limit": "mps",
    "memory_fraction": "fractional",
    "gpu_fraction": "fractional",
    "time_slicing": "time_sliced",
    "cgroup": "container_limited",
}
"""The sharing layer a reading's total below the device's shows."""
_FREE_SHOWS_SHARING = frozenset({"nvml", "cuda_runtime", "simulated"})
"""GPU readings whose free memory below their total means other processes hold some (a host's
MemAvailable is always below MemTotal: page tables, the kernel, every other process)."""
_PER_JOB = frozenset({"memory_fraction", "gpu_fraction", "time_slicing", "mps_limit", "ranks"})
"""Readings of one job's share, left out of the card's memory that ``trials_per_gpu`` divides."""
_HOST_ONLY = frozenset({"host", "cgroup"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BudgetReading:
    """What one source says about the memory this process may use, in bytes."""

    source: BudgetSource
    total_bytes: int
    """The memory the source says the device has in all, or the limit it sets (a vGPU limit,
    ``fraction * total``, a cgroup's ``memory.max``)."""
    available_bytes: int
    """What this process may use by this source: its free memory (plus what torch already
    reserved), or the limit."""
    free_bytes: int | None = None
    """What is free now by this source, for whether a plan fits now; None when the source does
    not read free memory (a limit, a label, a given size)."""
    detail: str = ""
    """How it was read, e.g. ``"CUDA_DEVICE_MEMORY_LIMIT_0='1024m'"``."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"budget source {self.source!r} must be one of {list(SOURCES)}")
        for name in ("total_bytes", "available_bytes", "free_bytes"):
            value = getattr(self, name)
            if value is None and name == "free_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"a budget reading's {name} must be an int >= 0, got {value!r}")
        if self.available_bytes > self.total_bytes:
            raise ConfigError(
                f"budget reading {self.source}: available_bytes {self.available_bytes} exceeds "
                f"total_bytes {self.total_bytes}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBudget:
    """The memory a job really has on a device: every source read, the smallest, how the device
    is shared, and (on a plan) whether the plan fits now and how many such plans fit per card."""

    budget_bytes: int
    """The smallest ``available_bytes`` of ``readings``: what a plan may use."""
    deciding_source: BudgetSource
    """The reading that decided ``budget_bytes``."""
    sharing_mode: SharingMode
    """How the device is shared (module docstring); ``"none"`` when the readings agree."""
    readings: tuple[BudgetReading, ...]
    """Every source read, in reading order."""
    card_memory_bytes: int
    """The whole card as this container sees it (the smallest total of the readings that are not
    one job's share: fractions, time-slicing replicas), the memory ``trials_per_gpu`` divides."""
    free_now_bytes: int | None = None
    """The smallest free memory now of the readings that read it; None when none did."""
    unseen_sources: tuple[str, ...] = ()
    """Sources that may limit the job but that this process cannot read (the service cannot see
    the CUDA runtime of a job's container, where a sharing layer such as HAMi limits it)."""
    warnings: tuple[str, ...] = ()
    """Every disagreement over :data:`SHARING_TOLERANCE`, every unseen source, and (on a plan)
    a peak over what is free now, in words."""
    fits_now: bool | None = None
    """On a plan: its predicted peak is within ``free_now_bytes``; None without either."""
    trials_per_gpu: int | None = None
    """On a plan for a GPU: how many processes running this plan fit on one card,
    ``int(card_memory_bytes * (1 - safety_margin)) // predicted_peak`` (the planner's budget
    arithmetic); None without a peak."""

    def __post_init__(self) -> None:
        if not self.readings:
            raise ConfigError("a memory budget needs at least one reading")
        if self.sharing_mode not in SHARING_MODES:
            raise ConfigError(
                f"sharing_mode {self.sharing_mode!r} must be one of {list(SHARING_MODES)}"
            )
        if self.deciding_source not in {r.source for r in self.readings}:
            raise ConfigError(
                f"deciding_source {self.deciding_source!r} is not among the readings' sources"
            )

    @property
    def is_gpu(self) -> bool:
        """True unless every reading is the host's (CPU memory)."""
        return any(r.source not in _HOST_ONLY for r in self.readings)

    def describe(self) -> str:
        """``"3.00 GiB, decided by cuda_runtime (sharing: virtualised)"``."""
        return (
            f"{format_bytes(self.budget_bytes)}, decided by {self.deciding_source} "
            f"(sharing: {self.sharing_mode})"
        )

    def for_peak(self, peak_bytes: int | None, *, safety_margin: float) -> MemoryBudget:
        """This budget with ``fits_now`` and ``trials_per_gpu`` for a plan of ``peak_bytes``
        (None: unknown) planned with ``safety_margin`` (0 <= x < 1), and a warning when the
        plan does not fit what is free now."""
        if peak_bytes is None or peak_bytes <= 0:
            return dataclasses.replace(self, fits_now=None, trials_per_gpu=None)
        fits_now = None if self.free_now_bytes is None else peak_bytes <= self.free_now_bytes
        warnings = self.warnings
        if fits_now is False:
            assert self.free_now_bytes is not None
            warnings = (
                *warnings,
                f"the plan's predicted peak {format_bytes(peak_bytes)} is more than the "
                f"{format_bytes(self.free_now_bytes)} free now: it fits only once other "
                "processes release their memory (fits_now is false)",
            )
        per_gpu = None
        if self.is_gpu:
            per_gpu = int(self.card_memory_bytes * (1 - safety_margin)) // peak_bytes
        return dataclasses.replace(
            self, fits_now=fits_now, trials_per_gpu=per_gpu, warnings=warnings
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        data = dataclasses.asdict(self)
        data["readings"] = [dataclasses.asdict(r) for r in self.readings]
        data["unseen_sources"] = list(self.unseen_sources)
        data["warnings"] = list(self.warnings)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryBudget:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: a field is missing, unknown or of the wrong kind.
        """
        try:
            fields = dict(data)
            fields["readings"] = tuple(BudgetReading(**r) for r in data["readings"])
            fields["unseen_sources"] = tuple(data.get("unseen_sources", ()))
            fields["warnings"] = tuple(data.get("warnings", ()))
            return cls(**fields)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not a valid memory budget: {exc}") from exc


def combine_budget(
    readings: Iterable[BudgetReading], *, unseen_sources: Iterable[str] = ()
) -> MemoryBudget:
    """The budget of ``readings`` by the rule in the module docstring.

    Args:
        readings: every source read, in reading order (at least one).
        unseen_sources: sources that may limit the job but could not be read; each adds a
            warning.

    Raises:
        ConfigError: no readings.
    """
    read = tuple(readings)
    if not read:
        raise ConfigError("a memory budget needs at least one reading")
    budget = min(r.available_bytes for r in read)
    decider = next(r for r in read if r.available_bytes == budget)
    whole = max(r.total_bytes for r in read)
    reference = next(r for r in read if r.total_bytes == whole)
    modes: dict[str, SharingMode] = {}
    warnings: list[str] = []
    for reading in read:
        mode = _mode_of(reading, whole)
        if mode is None:
            continue
        modes[reading.source] = mode
        warnings.append(_warning(reading, mode, reference))
    sharing: SharingMode = "none"
    if decider.source in modes:
        sharing = modes[decider.source]
    elif modes:
        sharing = next(iter(modes.values()))
    unseen = tuple(unseen_sources)
    for source in unseen:
        warnings.append(_UNSEEN.get(source, f"{source} could not be read"))
    card = [r.total_bytes for r in read if r.source not in _PER_JOB]
    free = [r.free_bytes for r in read if r.free_bytes is not None]
    return MemoryBudget(
        budget_bytes=budget,
        deciding_source=decider.source,
        sharing_mode=sharing,
        readings=read,
        card_memory_bytes=min(card) if card else whole,
        free_now_bytes=min(free) if free else None,
        unseen_sources=unseen,
        warnings=tuple(warnings),
    )


_UNSEEN = {
    "cuda_runtime": (
        "the CUDA runtime (torch.cuda.mem_get_info) was not read: a sharing layer in the job's "
        "container (HAMi, a vGPU device plugin, a fractional-GPU scheduler) would limit the job "
        "below this budget unseen; declare the share of the card the job gets (the GPU "
        "fraction), or plan for the limit the job gets as its capacity, or tune inside the job "
        "(where the runtime is read)"
    ),
}


def _mode_of(reading: BudgetReading, whole: int) -> SharingMode | None:
    below = whole * (1 - SHARING_TOLERANCE)
    if reading.source in _LIMIT_MODES and reading.total_bytes < below:
        return _LIMIT_MODES[reading.source]
    free = reading.free_bytes
    if (
        reading.source in _FREE_SHOWS_SHARING
        and free is not None
        and free < reading.total_bytes * (1 - SHARING_TOLERANCE)
    ):
        return "shared"
    return None


def _warning(reading: BudgetReading, mode: SharingMode, reference: BudgetReading) -> str:
    how = f" ({reading.detail})" if reading.detail else ""
    if mode == "shared":
        free = reading.free_bytes or 0
        return (
            f"{reading.source}: {format_bytes(reading.total_bytes - free)} of "
            f"{format_bytes(reading.total_bytes)} are held by other processes now"
            f"{how}: sharing mode shared"
        )
    return (
        f"{reading.source} allows {format_bytes(reading.total_bytes)} where {reference.source} "
        f"reports {format_bytes(reference.total_bytes)}, more than {SHARING_TOLERANCE:.0%} less"
        f"{how}: sharing mode {mode}"
    )


def check_gpu_fraction(value: object) -> float | None:
    """A declared ``gpu_fraction`` checked: None, or a number in (0, 1].

    Raises:
        ConfigError: anything else (names the value and the accepted range).
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not MIN_GPU_FRACTION < value <= MAX_GPU_FRACTION
    ):
        raise ConfigError(
            f"gpu_fraction {value!r} must be a number in (0, 1]: the share of the card this job "
            "gets (0.5 for two jobs on one card, as Ray's num_gpus=0.5), or None for the whole card"
        )
    return float(value)


def fraction_reading(
    source: Literal["memory_fraction", "gpu_fraction"],
    fraction: float,
    total_bytes: int,
    detail: str,
) -> BudgetReading:
    """``fraction * total_bytes`` (rounded down) as the ``source`` reading."""
    share = int(fraction * total_bytes)
    return BudgetReading(source=source, total_bytes=share, available_bytes=share, detail=detail)


def gpu_fraction_reading(gpu_fraction: float, total_bytes: int) -> BudgetReading:
    """The declared ``gpu_fraction`` (0 < x <= 1) of a card of ``total_bytes``, as the
    ``gpu_fraction`` reading every device and the service add last."""
    return fraction_reading(
        "gpu_fraction", gpu_fraction, total_bytes, f"gpu_fraction={gpu_fraction} declared"
    )


_LIMIT = re.compile(r"^\s*([0-9]+)\s*([kKmMgG]?)\s*$")
_LIMIT_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
VGPU_LIMIT_VARIABLE = "CUDA_DEVICE_MEMORY_LIMIT"
"""HAMi-core's variable (also set by Volcano's and other vGPU device plugins): ``_<i>`` for CUDA
device ``i`` of the container, or alone for every device."""


def parse_memory_limit(name: str, text: str) -> int:
    """A vGPU memory limit as HAMi-core reads it: a whole number with an optional binary unit
    ``k``, ``m`` or ``g`` (either case), bytes without one: ``"1g"``, ``"1024m"``,
    ``"1048576k"``, ``"1073741824"``. 0 means no limit.

    Raises:
        ConfigError: anything else (names the variable, its value and the accepted forms).
    """
    match = _LIMIT.match(text)
    if match is None:
        raise ConfigError(
            f"{name}={text!r} is not a memory limit: write a whole number with an optional unit "
            "k, m or g (binary), e.g. '1024m' or '3g', or bytes without one, as HAMi-core reads it"
        )
    return int(match.group(1)) * _LIMIT_UNITS[match.group(2).lower()]


def vgpu_limit_reading(environ: Mapping[str, str], cuda_index: int) -> BudgetReading | None:
    """The vGPU limit on CUDA device ``cuda_index`` from ``environ``:
    ``CUDA_DEVICE_MEMORY_LIMIT_<cuda_index>``, else ``CUDA_DEVICE_MEMORY_LIMIT`` (HAMi-core's
    order); None when neither is set, empty or 0 (no limit).

    Raises:
        ConfigError: a value that is not a memory limit (see :func:`parse_memory_limit`).
    """
    for name in (f"{VGPU_LIMIT_VARIABLE}_{cuda_index}", VGPU_LIMIT_VARIABLE):
        text = environ.get(name, "")
        if not text.strip():
            continue
        limit = parse_memory_limit(name, text)
        if limit > 0:
            return BudgetReading(
                source="vgpu_limit",
                total_bytes=limit,
                available_bytes=limit,
                detail=f"{name}={text.strip()!r}",
            )
    return None
