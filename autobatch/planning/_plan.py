"""PURE: the Plan, what a plan says (micro-batch sizes per rank, accumulation steps, ranks, the
memory and time it predicts, where its limit came from), and a world-size table's row.

:mod:`autobatch.planning._planner` makes them. Imports neither torch nor pynvml.

Example::

    plan = autobatch.plan(24, effective_batch_size=96)
    plan.micro_batch_size, plan.gradient_accumulation_steps, plan.formula()
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from autobatch.conditions import Conditions
from autobatch.device import MemoryBudget
from autobatch.errors import (
    ConfigError,
    Remedy,
    python_wording,
    with_remedies,
)
from autobatch.planning._epochs import EpochPlan, epoch_plan
from autobatch.planning._limits import (
    SOURCES,
    PlanSource,
)
from autobatch.planning._prediction import Prediction
from autobatch.profile import CheckpointingMode, GradientSync

__all__ = ["Plan", "WorldSizeOption", "formula_note"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """How to reach an effective batch: micro-batch sizes per rank, accumulation steps, ranks.

    Invariant, uniform plan (``rank_micro_batch_sizes`` None): ``sum(micro_batch_sizes) *
    world_size == effective_batch_size``. Mixed plan (one per rank, from
    :func:`~autobatch.planning.plan_mixed_ranks`): ``sum(rank_micro_batch_sizes) *
    gradient_accumulation_steps == effective_batch_size``, with ``world_size`` rank sizes, and
    this rank's ``micro_batch_sizes`` are ``gradient_accumulation_steps`` equal micro-batches of
    ``micro_batch_size``, one of ``rank_micro_batch_sizes``.
    """

    micro_batch_size: int
    """Samples per device per forward pass; the largest of ``micro_batch_sizes``."""
    gradient_accumulation_steps: int
    """Forward/backward passes per optimizer step, >= 1."""
    world_size: int
    """Data-parallel ranks (devices), >= 1."""
    effective_batch_size: int
    """Samples per optimizer step over all ranks, as reached by this plan."""
    requested_effective_batch_size: int
    """The effective batch asked for; differs from ``effective_batch_size`` only when inexact."""
    micro_batch_sizes: tuple[int, ...]
    """Size of each accumulation step's micro-batch, larger first; unequal (by exactly 1) only when
    asked for or needed, and then each loss must be weighted by its sample count."""
    rank_micro_batch_sizes: tuple[int, ...] | None = None
    """Every rank's micro-batch, in rank order, for a mixed plan (ranks on cards of different
    capacity or speed; this rank's is ``micro_batch_size``): each rank's loss must then be
    weighted by its share of the effective batch; None for the uniform plan (every rank runs
    ``micro_batch_sizes``)."""
    exact: bool
    """True when ``effective_batch_size == requested_effective_batch_size``."""
    max_micro_batch_size: int
    """The limit the plan respected (given, or derived from a profile and a capacity)."""
    predicted_peak_memory_bytes: int | None = None
    """Peak bytes of one step at ``micro_batch_size`` (measured or modelled); None if unknown."""
    capacity_bytes: int | None = None
    """Bytes the step may use on the device planned for; None if unknown."""
    headroom_bytes: int | None = None
    """``capacity_bytes - predicted_peak_memory_bytes``; None if either is unknown."""
    predicted_seconds_per_effective_batch: float | None = None
    """Seconds of compute per optimizer step on one rank (ranks run in parallel; gradient
    communication not included); None without step times."""
    source: PlanSource = "given"
    """Where the limit came from: ``"measured"`` (a probe's real trials), ``"cached"`` (real
    trials of a profile read from a store), ``"estimated"`` (fake-tensor estimate), ``"given"``
    (a number or memory line from the caller), or ``"predicted"``: past the largest micro-batch
    that really ran, from a line through measured peaks (see ``prediction``)."""
    prediction: Prediction | None = None
    """How a limit outside the measured sizes was predicted (the largest measured size, the
    line, its points and residual, the margin); None when the limit was measured or given."""
    notes: tuple[str, ...] = ()
    """Things the user should know: unequal sizes and how to weight losses, inexact targets, a
    bound from a failure other than memory, and for more than one rank :meth:`formula`."""
    eval_micro_batch_size: int | None = None
    """Samples per device per evaluation forward pass (under ``torch.inference_mode``, model in
    eval mode), from a probe of evaluation (``autotune(..., eval=True)``); None when not probed."""
    budget: MemoryBudget | None = None
    """The memory the job really has on the device planned for: every source read (NVML, the
    CUDA runtime, vGPU limits, fractions, the cgroup...), the one that decided
    ``capacity_bytes``, the sharing mode, whether the plan fits what is free now and
    ``trials_per_gpu`` (see :mod:`autobatch.device._budget`); None when the plan was made from
    numbers alone."""
    conditions: Conditions = dataclasses.field(default_factory=Conditions)
    """What its profile was measured under (``autotune``: with the plan's data-parallel size and
    source); empty from a number. Compared with the live process where the plan is used."""
    gradient_sync: GradientSync = dataclasses.field(default_factory=GradientSync)
    """The gradient-sync mode the profile behind the plan was measured in (its
    ``gradient_sync``); not recorded for a plan from a number or a memory line. The Accumulator
    refuses a plan measured in another mode than its loop runs."""
    activation_checkpointing: CheckpointingMode = "none"
    """The activation checkpointing mode to train with: ``"none"`` (the model as given),
    ``"selective"`` or ``"full"``; apply it with
    :func:`autobatch.probing.apply_activation_checkpointing` (or the framework's switch in the
    configs autobatch writes)."""
    epoch: EpochPlan | None = None
    """One epoch of data under this plan (:meth:`with_epoch`): micro-batches and optimizer steps
    per epoch per rank, and the effective batch the epoch's last step reaches; None when the
    data was not given."""

    def __post_init__(self) -> None:
        sizes = self.micro_batch_sizes
        if self.world_size < 1 or not sizes or min(sizes) < 1:
            raise ConfigError(
                f"plan needs world_size >= 1 and micro_batch_sizes >= 1, got world_size "
                f"{self.world_size} and micro_batch_sizes {list(sizes)}"
            )
        if len(sizes) != self.gradient_accumulation_steps:
            raise ConfigError(
                f"plan has {len(sizes)} micro_batch_sizes but gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps}; give one size per accumulation step"
            )
        if self.rank_micro_batch_sizes is not None:
            _check_rank_sizes(self)
        elif sum(sizes) * self.world_size != self.effective_batch_size:
            raise ConfigError(
                f"plan breaks the batch invariant: sum(micro_batch_sizes) {sum(sizes)} * "
                f"world_size {self.world_size} != effective_batch_size {self.effective_batch_size}"
            )
        if list(sizes) != sorted(sizes, reverse=True) or sizes[0] - sizes[-1] > 1:
            raise ConfigError(
                f"micro_batch_sizes {list(sizes)} must be non-increasing and differ by at most 1"
            )
        if self.micro_batch_size != sizes[0]:
            raise ConfigError(
                f"micro_batch_size {self.micro_batch_size} must be the largest of "
                f"micro_batch_sizes {list(sizes)}"
            )
        if self.micro_batch_size > self.max_micro_batch_size:
            raise ConfigError(
                f"micro_batch_size {self.micro_batch_size} exceeds max_micro_batch_size "
                f"{self.max_micro_batch_size}"
            )
        if self.exact != (self.effective_batch_size == self.requested_effective_batch_size):
            raise ConfigError(
                f"exact={self.exact} contradicts effective_batch_size {self.effective_batch_size}"
                f" vs requested {self.requested_effective_batch_size}"
            )
        if self.eval_micro_batch_size is not None and self.eval_micro_batch_size < 1:
            raise ConfigError(f"eval_micro_batch_size {self.eval_micro_batch_size} must be >= 1")
        if self.source not in SOURCES:
            raise ConfigError(f"plan source {self.source!r} must be one of {list(SOURCES)}")
        if self.source == "predicted" and self.prediction is None:
            raise ConfigError("a plan with source 'predicted' needs its prediction")

    @property
    def uneven(self) -> bool:
        """True when the micro-batches are of unequal size."""
        return self.micro_batch_sizes[0] != self.micro_batch_sizes[-1]

    def formula(self) -> str:
        """``E = m x k x dp`` in words: ``"effective_batch_size 64 = 16 (micro_batch_size) x 2
        (gradient_accumulation_steps) x 2 (data-parallel ranks)"``. Every plan for more than
        one rank has it among its ``notes``."""
        if self.rank_micro_batch_sizes is not None:
            return _rank_formula(
                self.rank_micro_batch_sizes,
                self.gradient_accumulation_steps,
                self.effective_batch_size,
            )
        return formula_note(self.micro_batch_sizes, self.effective_batch_size, self.world_size)

    def with_epoch(self, data: Any, *, drop_last: bool = False) -> Plan:
        """This plan with its :attr:`epoch`: what one epoch of ``data`` does under it (a note
        says so when its last optimizer step falls short of the effective batch).

        Args:
            data: the epoch's rows over all ranks (an int; each rank reads
                ``ceil(rows / world_size)``, as a padding ``DistributedSampler`` gives it), a
                sampler (its ``len()``: this rank's rows), or a loader built at this plan's
                micro-batch size (its sampler's ``len()`` and its ``drop_last``).
            drop_last: with rows or a sampler, whether the loader drops an incomplete last
                micro-batch.

        Raises:
            ConfigError: see :func:`autobatch.planning._epochs.epoch_plan`; or a mixed plan
                (its ranks read different numbers of rows, which the epoch plan does not model).
        """
        if self.rank_micro_batch_sizes is not None:
            raise ConfigError(
                "with_epoch plans uniform ranks only: the ranks of a mixed plan read different "
                "numbers of rows per micro-step (rank_micro_batch_sizes)"
            )
        epoch = epoch_plan(self.micro_batch_sizes, self.world_size, data, drop_last=drop_last)
        notes = self.notes
        if not epoch.fills_every_step:
            notes = (*notes, epoch.describe(self.effective_batch_size))
        return dataclasses.replace(self, epoch=epoch, notes=notes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["micro_batch_sizes"] = list(self.micro_batch_sizes)
        ranks = self.rank_micro_batch_sizes
        data["rank_micro_batch_sizes"] = None if ranks is None else list(ranks)
        data["notes"] = list(self.notes)
        data["prediction"] = None if self.prediction is None else self.prediction.to_dict()
        data["budget"] = None if self.budget is None else self.budget.to_dict()
        data["conditions"] = self.conditions.to_dict()
        data["gradient_sync"] = self.gradient_sync.to_dict()
        data["epoch"] = None if self.epoch is None else self.epoch.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: a field is missing, unknown or of the wrong kind, or the numbers break the
                batch invariant.
        """
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"not a valid plan: unknown fields {unknown}")
        try:
            fields = dict(data)
            fields["micro_batch_sizes"] = tuple(data["micro_batch_sizes"])
            ranks = data.get("rank_micro_batch_sizes")
            fields["rank_micro_batch_sizes"] = None if ranks is None else tuple(ranks)
            fields["notes"] = tuple(data.get("notes", ()))
            prediction = data.get("prediction")
            fields["prediction"] = None if prediction is None else Prediction.from_dict(prediction)
            budget = data.get("budget")
            fields["budget"] = None if budget is None else MemoryBudget.from_dict(budget)
            fields["conditions"] = Conditions.from_dict(data.get("conditions"))
            fields["gradient_sync"] = GradientSync.from_dict(data.get("gradient_sync"))
            fields["epoch"] = EpochPlan.from_dict(data.get("epoch"))
            return cls(**fields)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not a valid plan: {exc}") from exc


def formula_note(sizes: tuple[int, ...], effective: int, world_size: int) -> str:
    """:meth:`Plan.formula` from the numbers alone (the planner notes it before the Plan exists).

    Unequal micro-batches have no single m: the rank's sum stands for m x k, with its parts
    (``"194 = 97 (micro_batch_sizes summed over 5 gradient_accumulation_steps: 2 of 20, 3 of
    19) x 2 (data-parallel ranks)"``), so the numbers written multiply to E."""
    if sizes[0] == sizes[-1]:
        return (
            f"effective_batch_size {effective} = {sizes[0]} (micro_batch_size) x {len(sizes)} "
            f"(gradient_accumulation_steps) x {world_size} (data-parallel ranks)"
        )
    num_larger = sizes.count(sizes[0])
    return (
        f"effective_batch_size {effective} = {sum(sizes)} (micro_batch_sizes summed over "
        f"{len(sizes)} gradient_accumulation_steps: {num_larger} of {sizes[0]}, "
        f"{len(sizes) - num_larger} of {sizes[-1]}) x {world_size} (data-parallel ranks)"
    )


def _check_rank_sizes(plan: Plan) -> None:
    """A mixed plan's invariant (see :class:`Plan`).

    Raises:
        ConfigError: the rank sizes break it.
    """
    ranks, steps = plan.rank_micro_batch_sizes or (), plan.gradient_accumulation_steps
    if len(ranks) != plan.world_size or min(ranks, default=0) < 1:
        raise ConfigError(
            f"rank_micro_batch_sizes needs world_size {plan.world_size} sizes >= 1, got "
            f"{len(ranks)} with the smallest {min(ranks, default=None)}"
        )
    if sum(ranks) * steps != plan.effective_batch_size:
        raise ConfigError(
            f"plan breaks the batch invariant: sum(rank_micro_batch_sizes) {sum(ranks)} * "
            f"gradient_accumulation_steps {steps} != effective_batch_size "
            f"{plan.effective_batch_size}"
        )
    sizes = plan.micro_batch_sizes
    if sizes[0] != sizes[-1] or plan.micro_batch_size not in ranks:
        raise ConfigError(
            f"a mixed plan's micro_batch_sizes {list(sizes[:4])} must be equal and one of "
            "rank_micro_batch_sizes (this rank's micro_batch_size)"
        )


def _rank_formula(ranks: tuple[int, ...], steps: int, effective: int) -> str:
    """:meth:`Plan.formula` for a mixed plan: ``"effective_batch_size 96 = 48 (micro_batch_size
    summed over 2 ranks: 1 of 32, 1 of 16) x 2 (gradient_accumulation_steps)"``."""
    counts = collections.Counter(ranks)
    parts = ", ".join(f"{counts[size]} of {size}" for size in sorted(counts, reverse=True))
    return (
        f"effective_batch_size {effective} = {sum(ranks)} (micro_batch_size summed over "
        f"{len(ranks)} ranks: {parts}) x {steps} (gradient_accumulation_steps)"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorldSizeOption:
    """One row of :func:`plan_world_sizes`: a world size and its plan, or why there is none."""

    world_size: int
    """Data-parallel ranks considered."""
    plan: Plan | None
    """The plan at this world size; None when infeasible."""
    reason: str = ""
    """Why no plan exists at this world size; empty when ``plan`` is set. The fix is in
    ``remedies``; :meth:`describe` gives both."""
    remedies: tuple[Remedy, ...] = ()
    """Ways past it, named by library argument (see :class:`~autobatch.errors.Remedy`)."""

    def __post_init__(self) -> None:
        if (self.plan is None) == (not self.reason):
            raise ConfigError("a WorldSizeOption has either a plan or a reason, not both/neither")

    def describe(self, word: Callable[[Remedy], str] = python_wording) -> str:
        """The reason and its remedies, worded by ``word`` (default: in Python's terms)."""
        return with_remedies(self.reason, self.remedies, word)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``reason`` is :meth:`describe`'s."""
        return {
            "world_size": self.world_size,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "reason": self.describe(),
        }
