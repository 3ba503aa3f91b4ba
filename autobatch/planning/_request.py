"""PURE: what a plan needs besides its limit, checked once (:class:`PlanRequest`).

The one request object of planning: the effective batch, the ranks, the options every split
must meet, the memory to plan for and the step times. :func:`autobatch.plan` and
:func:`autobatch.plan_world_sizes` build it from their keyword arguments
(:meth:`PlanRequest.for_limit`), whose options are declared once here (:class:`SplitOptions`,
:class:`PlanOptions`); the CLI, the service and the tuning road build it themselves. Each
planning entry takes it whole (:func:`~autobatch.planning.plan_request`,
:func:`~autobatch.planning.plan_table`, :func:`~autobatch.planning.plan_mixed_ranks`) and does
not check it again. Imports neither torch nor pynvml.

Example::

    request = PlanRequest(effective_batch_size=512, world_size=8, multiple_of=8,
                          capacity_bytes=80 * 2**30)
    plan_request(profile, request).micro_batch_size
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from autobatch.conditions import check_world_size
from autobatch.errors import ConfigError, Remedy
from autobatch.margin import check_safety_margin
from autobatch.planning._limits import PlanSource, check_step_seconds, require_int, resolve_limit
from autobatch.profile import MemoryModel, Profile
from autobatch.units import check_capacity_bytes

__all__ = [
    "MAX_GRADIENT_ACCUMULATION_STEPS",
    "PlanOptions",
    "PlanRequest",
    "SplitOptions",
    "Uneven",
]

Uneven = Literal["auto", "never", "always"]
_UNEVEN: tuple[Uneven, ...] = ("auto", "never", "always")

MAX_GRADIENT_ACCUMULATION_STEPS = 1 << 20
"""No plan has more accumulation steps than this (1,048,576), whatever the caller allows: a Plan
lists one size per step, and a larger count is a mistake (a micro-batch limit of 1 for a
billion-sample batch) rather than a training run. Also bounds the planner's own work."""


class SplitOptions(TypedDict, total=False):
    """The options of a plan besides its effective batch and its ranks: the keyword options of
    :func:`autobatch.plan_world_sizes` and the client's plan calls, each a :class:`PlanRequest`
    field of the same name and meaning (a test keeps the two equal)."""

    multiple_of: int
    max_gradient_accumulation_steps: int | None
    uneven: Uneven
    allow_inexact: bool
    safety_margin: float | None
    capacity_bytes: int | None
    step_seconds: Mapping[int, float] | None


class PlanOptions(SplitOptions, total=False):
    """:class:`SplitOptions` and the plan's ``world_size``: the keyword options of
    :func:`autobatch.plan` (whose check against this process needs to know whether
    ``world_size`` was given)."""

    world_size: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """The effective batch, the ranks, the options every split must meet, and what to plan for.

    Checked on construction, in the planner's order: the options (``multiple_of``,
    ``max_gradient_accumulation_steps``, ``uneven``, ``allow_inexact`` and how they combine),
    then what resolves the limit (``safety_margin``, ``capacity_bytes``, ``step_seconds``), then
    ``effective_batch_size``, ``world_size`` and how they combine, then ``world_sizes``. Whether
    ``capacity_bytes`` and ``safety_margin`` suit the limit (a number takes neither) is the
    planner's to say, when it has the limit.

    Raises:
        ConfigError: a field is out of range or of the wrong kind (a bool where an int
            belongs), ``max_gradient_accumulation_steps`` is over
            :data:`~autobatch.planning.MAX_GRADIENT_ACCUMULATION_STEPS`, ``uneven="always"``
            with ``multiple_of > 1``, ``effective_batch_size < world_size``, or ``world_sizes``
            is not a list of ints >= 1 (names the value and the fix).
    """

    effective_batch_size: int
    """Samples per optimizer step over all ranks, >= ``world_size``."""
    world_size: int = 1
    """Data-parallel ranks of the plan, >= 1."""
    multiple_of: int = 1
    """Every micro-batch size is a multiple of this (e.g. 8 for tensor cores); > 1 rules out
    unequal sizes."""
    max_gradient_accumulation_steps: int | None = None
    """Upper bound on accumulation steps, at most ``MAX_GRADIENT_ACCUMULATION_STEPS``; None for
    that bound alone."""
    uneven: Uneven = "auto"
    """``"auto"``, ``"never"`` or ``"always"``: when micro-batches may differ in size (by 1);
    see :mod:`autobatch.planning._planner`."""
    allow_inexact: bool = False
    """Plan the nearest reachable effective batch size (ties go below) when none reaches
    ``effective_batch_size`` exactly, instead of raising."""
    safety_margin: float | None = None
    """Fraction of the capacity kept free, in [0, 1), for a profile or a memory model; None: the
    profile's own (:data:`~autobatch.margin.DEFAULT_SAFETY_MARGIN` for a memory model)."""
    capacity_bytes: int | None = None
    """Plan for a device with this many usable bytes (>= 1 MiB: less is taken for a unit left
    off, :func:`autobatch.units.check_capacity_bytes`): a profile scales its measured peaks
    to it, a memory model needs it. None: the device the profile was measured on."""
    step_seconds: Mapping[int, float] | None = None
    """Measured seconds per training step by micro-batch size (two sizes or more, each > 0),
    taken as exact; None: the profile's fitting trials, for the device they ran on."""
    world_sizes: tuple[int, ...] | None = None
    """Candidate numbers of ranks for a table (:func:`~autobatch.planning.plan_table`), e.g.
    ``(1, 2, 4, 8)``, rows in this order; None for no table. ``world_size`` is not used by the
    table."""

    def __post_init__(self) -> None:
        _check_options(self)
        if self.safety_margin is not None:
            check_safety_margin(self.safety_margin)
        if self.capacity_bytes is not None:
            require_int("capacity_bytes", self.capacity_bytes, 1)
            check_capacity_bytes(self.capacity_bytes)  # under 1 MiB: a unit left off
        if self.step_seconds is not None:
            check_step_seconds(self.step_seconds, "step_seconds")
        effective, world_size = self.effective_batch_size, self.world_size
        require_int("effective_batch_size", effective, 1)
        check_world_size(world_size)
        if effective < world_size:
            raise ConfigError(
                f"effective_batch_size {effective} is less than world_size {world_size}: every "
                f"rank needs a sample; use effective_batch_size >= {world_size} or world_size <= "
                f"{effective}"
            )
        if self.world_sizes is not None:
            object.__setattr__(self, "world_sizes", _checked_world_sizes(self.world_sizes))

    @classmethod
    def for_limit(
        cls,
        limit: int | Profile | MemoryModel,
        *,
        source: PlanSource | None = None,
        **fields: Any,
    ) -> PlanRequest:
        """The request of ``fields``, for a plan within ``limit``; when refused, the error in
        the planner's order: the options and what resolves the limit first, then the limit
        itself, then the batch sizes and world sizes. So a call wrong in its limit and in
        ``effective_batch_size`` or ``world_size`` is told of the limit. Only this error path
        checks twice.

        Raises:
            ConfigError: a field is invalid (as on construction), or ``limit`` or ``source`` is
                (as for :func:`~autobatch.planning.plan_request`).
            NoFeasiblePlanError: the model does not fit at micro-batch 1 in
                ``capacity_bytes``, when a field is invalid too.
        """
        try:
            return cls(**fields)
        except ConfigError as refused:
            # The same request with batch sizes that always pass: raises if the limit's
            # refusal comes first.
            fine = cls(
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

    def check_mixed_ranks(self) -> None:
        """Refuse what a mixed plan (:func:`~autobatch.planning.plan_mixed_ranks`) does not do,
        by name: an inexact effective batch, a table of world sizes, or step times given for
        one card.

        Raises:
            ConfigError: names the option and the fix.
        """
        refused = (
            (
                "allow_inexact",
                self.allow_inexact,
                "it meets the effective batch exactly or names the nearest reachable ones",
            ),
            ("world_sizes", self.world_sizes is not None, "its world size is its ranks'"),
            (
                "step_seconds",
                self.step_seconds is not None,
                "each rank's step times are its own profile's",
            ),
        )
        for name, given, why in refused:
            if given:
                raise ConfigError(
                    f"{name} does not go with a mixed plan (a micro-batch per rank): {why}; "
                    f"leave {name} unset"
                )

    @property
    def max_steps(self) -> int:
        """The most accumulation steps a plan may take: ``max_gradient_accumulation_steps``, or
        :data:`MAX_GRADIENT_ACCUMULATION_STEPS` when that is None."""
        return self.max_gradient_accumulation_steps or MAX_GRADIENT_ACCUMULATION_STEPS

    @property
    def unequal_allowed(self) -> bool:
        """Whether micro-batches may differ in size (by 1)."""
        return self.multiple_of == 1 and self.uneven != "never"


def _check_options(request: PlanRequest) -> None:
    """The checks that involve neither the batch sizes nor the limit, in order."""
    multiple_of, most = request.multiple_of, request.max_gradient_accumulation_steps
    require_int("multiple_of", multiple_of, 1)
    if most is not None:
        require_int("max_gradient_accumulation_steps", most, 1)
        if most > MAX_GRADIENT_ACCUMULATION_STEPS:
            # Refused rather than clamped, so no error names a bound the caller did not set.
            raise ConfigError(
                f"max_gradient_accumulation_steps {most} is more than the planner plans (at "
                f"most {MAX_GRADIENT_ACCUMULATION_STEPS} accumulation steps)",
                remedies=(
                    Remedy(
                        parameter="max_gradient_accumulation_steps",
                        values=(MAX_GRADIENT_ACCUMULATION_STEPS,),
                    ),
                ),
            )
    if request.uneven not in _UNEVEN:
        raise ConfigError(f"uneven {request.uneven!r} must be one of {list(_UNEVEN)}")
    if not isinstance(request.allow_inexact, bool):
        raise ConfigError(f"allow_inexact {request.allow_inexact!r} must be a bool")
    if request.uneven == "always" and multiple_of > 1:
        raise ConfigError(
            f"uneven 'always' cannot hold with multiple_of {multiple_of}: sizes that differ by 1 "
            "cannot all be multiples of it",
            remedies=(
                Remedy(parameter="uneven", values=("auto",)),
                Remedy(parameter="multiple_of", values=(1,)),
            ),
        )


def _checked_world_sizes(world_sizes: object) -> tuple[int, ...]:
    """``world_sizes`` as a tuple of ints >= 1.

    Raises:
        ConfigError: not a sequence (an int or a string included), or a world size that is not
            an int >= 1.
    """
    if isinstance(world_sizes, int | str) or not isinstance(world_sizes, Sequence):
        raise ConfigError(
            f"world_sizes {world_sizes!r} must be a list of ints, e.g. [1, 2, 4, 8]; for one "
            "world size use plan(...)"
        )
    for world_size in world_sizes:
        check_world_size(world_size)
    return tuple(world_sizes)
