"""Split an effective batch into micro-batches and accumulation steps: numbers in, Plan out.

PURE: imports neither torch nor pynvml, so schedulers and the service can plan on machines
without a GPU, a driver, or torch.

Rules (docs/how-it-works.md, "Planner rules"), with ``E = effective_batch_size``,
``W = world_size``, ``P = E / W`` samples per rank, ``M`` the largest micro-batch that may run,
``k`` accumulation steps and ``m`` the micro-batch size:

- ``E`` must be a positive multiple of ``W``.
- Fewest ``k`` first, then the largest ``m <= M`` with ``m * k * W == E``.
- Micro-batches of unequal size (differing by 1, larger first) are used when equal ones would
  need many more steps. ``uneven="auto"`` (the default) uses equal sizes when some equal split
  meets every constraint with ``k <= 2 * ceil(P / M)``; otherwise (``P`` prime, say) it uses the
  minimal ``k = ceil(P / M)`` with unequal sizes. ``"never"`` only plans equal sizes, ``"always"``
  always uses the minimal ``k``. Unequal sizes need each micro-batch's loss weighted by its share
  of the ``P`` samples (not ``1 / k``) for the gradient to equal the full batch's.
- With step times, another split than the fewest steps wins only by a difference measured more
  than once and beyond the timings' spread (:func:`~autobatch.planning._splits.choose_steps`);
  given ``step_seconds`` are taken as exact. The notes show the timings behind the choice.

Example::

    >>> p = plan(24, effective_batch_size=64)
    >>> p.micro_batch_size, p.gradient_accumulation_steps
    (16, 4)
    >>> plan(24, effective_batch_size=97).micro_batch_sizes
    (20, 20, 19, 19, 19)

    # What a probed model would get on 8 cards with 80 GiB each:
    plan(profile, effective_batch_size=512, world_size=8, capacity_bytes=80 * 2**30)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autobatch.conditions import Conditions
from autobatch.device import MemoryBudget
from autobatch.errors import (
    ConfigError,
    NoFeasiblePlanError,
    Remedy,
    python_wording,
    with_remedies,
)
from autobatch.planning._epochs import EpochPlan, epoch_plan
from autobatch.planning._limits import (
    DEFAULT_SAFETY_MARGIN,
    SOURCES,
    Limit,
    PlanSource,
    resolve_limit,
)
from autobatch.planning._prediction import Prediction
from autobatch.planning._request import MAX_GRADIENT_ACCUMULATION_STEPS, PlanRequest, Uneven
from autobatch.planning._splits import (
    choose_steps,
    describe_rules,
    nearest_reachable,
    split_seconds,
    split_sizes,
)
from autobatch.profile import GradientSync, MemoryModel, Profile

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "MAX_GRADIENT_ACCUMULATION_STEPS",
    "Plan",
    "PlanSource",
    "Uneven",
    "WorldSizeOption",
    "largest_useful_micro_batch_size",
    "plan",
    "plan_request",
    "plan_table",
    "plan_world_sizes",
    "resolve_plan_limit",
]


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
        return _formula(self.micro_batch_sizes, self.effective_batch_size, self.world_size)

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


def _formula(sizes: tuple[int, ...], effective: int, world_size: int) -> str:
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


def largest_useful_micro_batch_size(effective_batch_size: int, world_size: int) -> int:
    """``ceil(effective_batch_size / world_size)``: no plan for that request uses a larger
    micro-batch (the nearest reachable effective batch size included), so no probe for it needs
    to try one. Both arguments are positive ints (checked by :func:`plan`)."""
    return -(-effective_batch_size // world_size)


def plan(
    limit: int | Profile | MemoryModel,
    *,
    effective_batch_size: int,
    world_size: int = 1,
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    uneven: Uneven = "auto",
    allow_inexact: bool = False,
    safety_margin: float | None = None,
    capacity_bytes: int | None = None,
    step_seconds: Mapping[int, float] | None = None,
    source: PlanSource | None = None,
) -> Plan:
    """Plan micro-batches and accumulation steps that reach ``effective_batch_size``.

    Args:
        limit: the largest micro-batch that may run per device (an int >= 1); a
            :class:`~autobatch.profile.Profile`, whose ``recommended_micro_batch_size`` is used
            (or, with ``capacity_bytes``, the largest size its measured peaks put under that
            capacity: read off the peaks within the measured sizes, predicted past them); or a
            :class:`~autobatch.profile.MemoryModel` (a peak-bytes line) with ``capacity_bytes``.
        effective_batch_size: samples per optimizer step over all ranks, a positive multiple of
            ``world_size``.
        world_size: data-parallel ranks, >= 1.
        multiple_of: every micro-batch size must be a multiple of this (e.g. 8 for tensor
            cores); > 1 rules out unequal sizes.
        max_gradient_accumulation_steps: upper bound on accumulation steps; None for no bound.
        uneven: ``"auto"``, ``"never"`` or ``"always"``; see the module docstring for the rule.
        allow_inexact: when no plan reaches ``effective_batch_size`` exactly, return the plan for
            the nearest reachable one (ties go below) with ``exact=False``, instead of raising.
        safety_margin: fraction of capacity kept free (0 <= x < 1), profile or memory model
            only; default the profile's own (``DEFAULT_SAFETY_MARGIN`` for a memory model).
        capacity_bytes: plan for a device with this many usable bytes (e.g. an 80 GiB card),
            profile (needs peaks at two sizes, or its memory model) or memory model (required).
        step_seconds: measured seconds per training step by micro-batch size (two sizes or more);
            by default the profile's fitting trials with a time, when the plan is for the device
            they ran on.
        source: where ``limit`` came from, said by the caller that knows: ``"measured"`` (a
            probe just run), ``"cached"`` (a profile read from a store), ``"estimated"`` or
            ``"given"``. Default: ``"estimated"`` for an estimate's profile, ``"measured"`` for
            another profile, ``"given"`` for a number or a memory model. The planner alone
            turns it into ``"predicted"`` when a profile's limit lies outside its measured
            sizes (an estimate's stays ``"estimated"``, with the prediction attached).

    Returns:
        The :class:`Plan`.

    Raises:
        ConfigError: an argument is invalid (named with its value): ``effective_batch_size`` not
            a positive multiple of ``world_size`` (the message names the nearest reachable values),
            a bool where an int belongs, ``uneven="always"`` with ``multiple_of > 1``, a
            ``source`` that is unknown, ``"predicted"`` or ``"measured"``/``"cached"`` for an
            estimate; or a profile that cannot predict for ``capacity_bytes``: peaks that do not
            grow with the micro-batch, are not on a line, or were measured at fewer than two
            sizes without a memory model (probe on that card).
        NoFeasiblePlanError: no split meets every constraint (the message names the nearest
            reachable effective batch sizes below and above), or the model does not fit at
            micro-batch 1 in ``capacity_bytes``.
    """
    fields = {
        "effective_batch_size": effective_batch_size,
        "world_size": world_size,
        "multiple_of": multiple_of,
        "max_gradient_accumulation_steps": max_gradient_accumulation_steps,
        "uneven": uneven,
        "allow_inexact": allow_inexact,
        "safety_margin": safety_margin,
        "capacity_bytes": capacity_bytes,
        "step_seconds": step_seconds,
    }
    return plan_request(limit, _request_in_order(limit, fields, source), source=source)


def plan_request(
    limit: int | Profile | MemoryModel, request: PlanRequest, *, source: PlanSource | None = None
) -> Plan:
    """The plan for ``request`` within ``limit``: what :func:`plan` returns, for a caller holding
    a checked :class:`PlanRequest` (the CLI, the service, the tuning road). ``world_sizes`` is
    not planned here (:func:`plan_table`).

    Args:
        limit: as for :func:`plan`.
        request: the effective batch, world size, options and what to plan for.
        source: as for :func:`plan`.

    Raises:
        ConfigError: the limit or ``source`` is invalid, the limit does not take
            ``capacity_bytes`` or ``safety_margin``, or no plan reaches the effective batch size
            for a reason an argument can fix (as for :func:`plan`).
        NoFeasiblePlanError: as for :func:`plan`.
    """
    return _measured_in(_plan(resolve_plan_limit(limit, request, source), request), limit)


def plan_table(
    limit: int | Profile | MemoryModel, request: PlanRequest, *, source: PlanSource | None = None
) -> list[WorldSizeOption]:
    """One :class:`WorldSizeOption` per world size of ``request.world_sizes`` (none without
    them): what :func:`plan_world_sizes` returns, for a caller holding a checked request.
    ``request.world_size`` is not used.

    Raises:
        ConfigError, NoFeasiblePlanError: as for :func:`plan_world_sizes`.
    """
    return _table_within(resolve_plan_limit(limit, request, source), request, limit)


def _measured_in(result: Plan, limit: int | Profile | MemoryModel) -> Plan:
    """``result`` with the gradient-sync mode of the profile it was planned from, if any."""
    if not isinstance(limit, Profile):
        return result
    return dataclasses.replace(result, gradient_sync=limit.gradient_sync)


def _request_in_order(
    limit: int | Profile | MemoryModel, fields: Mapping[str, Any], source: PlanSource | None
) -> PlanRequest:
    """The :class:`PlanRequest` of ``fields``; when refused, the error in the planner's order:
    the options and what resolves the limit first, then the limit itself, then the batch sizes
    and world sizes. So a request wrong in its limit and in ``effective_batch_size`` or
    ``world_size`` is told of the limit, as it always was; only this error path checks twice."""
    try:
        return PlanRequest(**fields)
    except ConfigError as refused:
        # The same request with batch sizes that always pass: raises if the refusal came first.
        fine = PlanRequest(
            **{**fields, "effective_batch_size": 1, "world_size": 1, "world_sizes": None}
        )
        resolve_limit(
            limit,
            capacity_bytes=fine.capacity_bytes,
            safety_margin=fine.safety_margin,
            step_seconds=fine.step_seconds,
            source=source,
        )
        raise refused from None


def resolve_plan_limit(
    limit: int | Profile | MemoryModel, request: PlanRequest, source: PlanSource | None
) -> Limit:
    """The limit :func:`plan_request` and :func:`plan_table` plan within
    (:func:`~autobatch.planning._limits.resolve_limit`). A profile whose search a failure other
    than memory bounded says so in every plan."""
    resolved = resolve_limit(
        limit,
        capacity_bytes=request.capacity_bytes,
        safety_margin=request.safety_margin,
        step_seconds=request.step_seconds,
        source=source,
    )
    if not isinstance(limit, Profile):
        return resolved
    resolved.conditions = limit.conditions
    if not limit.failure_note:
        return resolved
    return dataclasses.replace(resolved, notes=(limit.failure_note, *resolved.notes))


def plan_world_sizes(
    limit: int | Profile | MemoryModel,
    *,
    effective_batch_size: int,
    world_sizes: Sequence[int],
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    uneven: Uneven = "auto",
    allow_inexact: bool = False,
    safety_margin: float | None = None,
    capacity_bytes: int | None = None,
    step_seconds: Mapping[int, float] | None = None,
    source: PlanSource | None = None,
) -> list[WorldSizeOption]:
    """Plan ``effective_batch_size`` at each of ``world_sizes``, for a scheduler choosing N GPUs.

    Args:
        limit: as for :func:`plan`.
        effective_batch_size: as for :func:`plan`.
        world_sizes: candidate numbers of ranks, e.g. ``[1, 2, 4, 8]``; rows keep this order.
        multiple_of, max_gradient_accumulation_steps, uneven, allow_inexact, safety_margin,
            capacity_bytes, step_seconds, source: as for :func:`plan`.

    Returns:
        One :class:`WorldSizeOption` per world size: the plan, or the reason it is infeasible
        there (``effective_batch_size`` not a multiple of it, or no split meets the constraints).

    Raises:
        ConfigError: an argument that does not depend on the world size is invalid, or a world
            size is not an int >= 1.
        NoFeasiblePlanError: the model does not fit at micro-batch 1 in ``capacity_bytes`` (no
            world size helps).
    """
    fields = {
        # One world size stands in for the rows': the checks that involve it come per row.
        "effective_batch_size": effective_batch_size,
        "world_size": 1,
        "world_sizes": world_sizes,
        "multiple_of": multiple_of,
        "max_gradient_accumulation_steps": max_gradient_accumulation_steps,
        "uneven": uneven,
        "allow_inexact": allow_inexact,
        "safety_margin": safety_margin,
        "capacity_bytes": capacity_bytes,
        "step_seconds": step_seconds,
    }
    return plan_table(limit, _request_in_order(limit, fields, source), source=source)


def _table_within(
    limit: Limit, request: PlanRequest, planned_from: int | Profile | MemoryModel
) -> list[WorldSizeOption]:
    """:func:`plan_table`'s rows within a resolved limit: a request a world size cannot reach
    (fewer samples than ranks, not a multiple of it, no split) is its row."""
    rows = []
    for world_size in request.world_sizes or ():
        try:
            row = dataclasses.replace(request, world_size=world_size, world_sizes=None)
            result = _measured_in(_plan(limit, row), planned_from)
        except (ConfigError, NoFeasiblePlanError) as exc:
            rows.append(
                WorldSizeOption(
                    world_size=world_size, plan=None, reason=exc.message, remedies=exc.remedies
                )
            )
        else:
            rows.append(WorldSizeOption(world_size=world_size, plan=result))
    return rows


def _plan(limit: Limit, constraints: PlanRequest) -> Plan:
    effective, world_size = constraints.effective_batch_size, constraints.world_size
    largest = limit.max_micro_batch_size
    if constraints.multiple_of > largest:
        raise NoFeasiblePlanError(
            f"multiple_of {constraints.multiple_of} exceeds the max micro-batch size "
            f"{largest}: no micro-batch size is allowed; lower multiple_of"
        )
    notes = list(limit.notes)
    target = effective
    chosen = None
    if effective % world_size == 0:
        chosen = choose_steps(effective // world_size, largest, constraints, limit.step_time)
    if chosen is None:
        below, above = nearest_reachable(largest, constraints)
        nearest = tuple(v for v in (below, above) if v is not None)
        inexact = Remedy(parameter="allow_inexact", values=(True,), purpose="plan the nearest")
        if effective % world_size:
            cause = f"effective_batch_size {effective} is not a multiple of world_size {world_size}"
        else:
            cause = (
                f"no plan reaches effective_batch_size {effective} on world_size {world_size} "
                f"with {describe_rules(effective // world_size, largest, constraints)}"
            )
        if not constraints.allow_inexact and effective % world_size:
            use = [Remedy(parameter="effective_batch_size", values=nearest)] if nearest else []
            raise ConfigError(cause, remedies=[*use, inexact])
        if not constraints.allow_inexact:
            raise NoFeasiblePlanError(
                f"{cause}; nearest reachable effective_batch_size: "
                f"{below if below is not None else 'none'} below, "
                f"{above if above is not None else 'none'} above",
                remedies=(inexact, Remedy(purpose="looser constraints")),
            )
        target = min(nearest, key=lambda v: abs(v - effective))
        chosen = choose_steps(target // world_size, largest, constraints, limit.step_time)
        assert chosen is not None, "a reachable effective batch size must have a plan"
        notes.append(f"{cause}; planned the nearest, {target}")
    steps, note = chosen
    if note:
        notes.append(note)
    per_rank = target // world_size
    sizes = split_sizes(per_rank, steps)
    if sizes[0] != sizes[-1]:
        num_larger = per_rank % steps
        notes.append(
            f"unequal micro-batches ({num_larger} of {sizes[0]}, {steps - num_larger} of "
            f"{sizes[-1]}): weight each micro-batch's loss by its size / {per_rank}, not "
            f"1 / {steps}, so the gradient equals the full batch's"
        )
    if world_size > 1:
        notes.append(_formula(sizes, target, world_size))
    peak = limit.peak_bytes(sizes[0])
    return Plan(
        micro_batch_size=sizes[0],
        gradient_accumulation_steps=steps,
        world_size=world_size,
        effective_batch_size=target,
        requested_effective_batch_size=effective,
        micro_batch_sizes=sizes,
        exact=target == effective,
        max_micro_batch_size=largest,
        predicted_peak_memory_bytes=peak,
        capacity_bytes=limit.capacity_bytes,
        headroom_bytes=(
            None if peak is None or limit.capacity_bytes is None else limit.capacity_bytes - peak
        ),
        predicted_seconds_per_effective_batch=(
            None
            if limit.step_time is None
            else split_seconds(per_rank, steps, limit.step_time.seconds)
        ),
        source=limit.source,
        prediction=limit.prediction,
        notes=tuple(notes),
        conditions=limit.conditions,
    )
