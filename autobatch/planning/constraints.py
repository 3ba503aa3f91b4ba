"""PURE: what a plan must respect besides its limit, checked once (:class:`PlanConstraints`).

:func:`autobatch.planning.plan` builds the constraints from its flat keyword arguments; a caller
that plans more than once for one request (the tuning road: before probing, then from the
profile) builds them once and hands them to :func:`autobatch.planning.plan_within`, which does
not check them again. Imports neither torch nor pynvml.

Example::

    constraints = PlanConstraints(effective_batch_size=512, world_size=8, multiple_of=8)
    plan_within(profile, constraints, capacity_bytes=80 * 2**30)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from autobatch.errors import ConfigError, Remedy
from autobatch.planning.limits import require_int

__all__ = ["MAX_GRADIENT_ACCUMULATION_STEPS", "PlanConstraints", "Uneven", "check_options"]

Uneven = Literal["auto", "never", "always"]
_UNEVEN: tuple[Uneven, ...] = ("auto", "never", "always")

MAX_GRADIENT_ACCUMULATION_STEPS = 1 << 20
"""No plan has more accumulation steps than this (1,048,576), whatever the caller allows: a Plan
lists one size per step, and a larger count is a mistake (a micro-batch limit of 1 for a
billion-sample batch) rather than a training run. Also bounds the planner's own work."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanConstraints:
    """The effective batch, the ranks and the options every split must meet.

    Checked on construction, in the planner's order: ``multiple_of``,
    ``max_gradient_accumulation_steps``, ``uneven``, ``allow_inexact`` and how they combine
    (:func:`check_options`), then ``effective_batch_size``, ``world_size`` and how they combine.
    :func:`~autobatch.planning.plan` resolves its limit between the two (a request wrong in
    its limit and in a batch size is told of the limit), so it checks the options again when
    these constraints are refused.

    Raises:
        ConfigError: a field is out of range or of the wrong kind (a bool where an int
            belongs), ``max_gradient_accumulation_steps`` is over
            :data:`~autobatch.planning.MAX_GRADIENT_ACCUMULATION_STEPS`, ``uneven="always"``
            with ``multiple_of > 1``, or ``effective_batch_size < world_size``.
    """

    effective_batch_size: int
    """Samples per optimizer step over all ranks, >= ``world_size``."""
    world_size: int = 1
    """Data-parallel ranks, >= 1."""
    multiple_of: int = 1
    """Every micro-batch size is a multiple of this (> 1 rules out unequal sizes)."""
    max_gradient_accumulation_steps: int | None = None
    """Upper bound on accumulation steps, at most ``MAX_GRADIENT_ACCUMULATION_STEPS``; None for
    that bound alone."""
    uneven: Uneven = "auto"
    """``"auto"``, ``"never"`` or ``"always"``: when micro-batches may differ in size (by 1);
    see :mod:`autobatch.planning.planner`."""
    allow_inexact: bool = False
    """Plan the nearest reachable effective batch size (ties go below) when none reaches
    ``effective_batch_size`` exactly, instead of raising."""

    def __post_init__(self) -> None:
        check_options(
            self.multiple_of, self.max_gradient_accumulation_steps, self.uneven, self.allow_inexact
        )
        effective, world_size = self.effective_batch_size, self.world_size
        require_int("effective_batch_size", effective, 1)
        require_int("world_size", world_size, 1)
        if effective < world_size:
            raise ConfigError(
                f"effective_batch_size {effective} is less than world_size {world_size}: every "
                f"rank needs a sample; use effective_batch_size >= {world_size} or world_size <= "
                f"{effective}"
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


def check_options(
    multiple_of: int,
    max_gradient_accumulation_steps: int | None,
    uneven: Uneven,
    allow_inexact: bool,
) -> None:
    """The checks of :class:`PlanConstraints` that do not involve the batch sizes, in order.

    Raises:
        ConfigError: as for :class:`PlanConstraints`.
    """
    require_int("multiple_of", multiple_of, 1)
    if max_gradient_accumulation_steps is not None:
        require_int("max_gradient_accumulation_steps", max_gradient_accumulation_steps, 1)
        if max_gradient_accumulation_steps > MAX_GRADIENT_ACCUMULATION_STEPS:
            # Once clamped silently: the error then named a bound the caller had not set.
            raise ConfigError(
                f"max_gradient_accumulation_steps {max_gradient_accumulation_steps} is more "
                f"than the planner plans (at most {MAX_GRADIENT_ACCUMULATION_STEPS} "
                "accumulation steps)",
                remedies=(
                    Remedy(
                        parameter="max_gradient_accumulation_steps",
                        values=(MAX_GRADIENT_ACCUMULATION_STEPS,),
                    ),
                ),
            )
    if uneven not in _UNEVEN:
        raise ConfigError(f"uneven {uneven!r} must be one of {list(_UNEVEN)}")
    if not isinstance(allow_inexact, bool):
        raise ConfigError(f"allow_inexact {allow_inexact!r} must be a bool")
    if uneven == "always" and multiple_of > 1:
        raise ConfigError(
            f"uneven 'always' cannot hold with multiple_of {multiple_of}: sizes that differ by 1 "
            "cannot all be multiples of it",
            remedies=(
                Remedy(parameter="uneven", values=("auto",)),
                Remedy(parameter="multiple_of", values=(1,)),
            ),
        )
