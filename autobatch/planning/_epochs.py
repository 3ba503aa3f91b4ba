"""A plan over one epoch of data: micro-batches and optimizer steps per epoch per rank, and the
effective batch the epoch's last step really reaches.

PURE (no torch): a loader or a sampler is read by duck typing (``len()``, ``.sampler``,
``.batch_size``, ``.drop_last``).

The frameworks (Lightning, the Hugging Face Trainer, Accelerate) and the Accumulator group an
epoch's micro-batches into windows of ``gradient_accumulation_steps`` in order and step at the
epoch's end with what is left, so when the rows do not fill whole windows the last optimizer step
sees fewer samples than ``effective_batch_size``; and when an epoch cannot fill one window, every
step does. :func:`epoch_plan` says how many steps, and what they reach, so ``max_steps`` and LR
schedules can be set from it.

Example::

    >>> from autobatch.planning import PlanRequest, plan_request
    >>> request = PlanRequest(effective_batch_size=256)
    >>> p = plan_request(8, request).with_epoch(125)   # 125 rows, 8 x 32
    >>> p.epoch.num_optimizer_steps, p.epoch.last_effective_batch_size
    (1, 125)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from autobatch.errors import ConfigError

__all__ = ["EpochPlan", "epoch_plan"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EpochPlan:
    """One epoch of data under a plan, per rank (every rank reads as many rows: a
    ``DistributedSampler`` pads them)."""

    num_rows_per_rank: int
    """Rows each rank reads per epoch (``ceil(rows / world_size)`` for a padding
    ``DistributedSampler``; a sampler's ``len()``)."""
    drop_last: bool
    """Whether the loader drops an epoch's last, incomplete micro-batch."""
    num_micro_batches_per_rank: int
    """Micro-batches (forward/backward passes) each rank runs per epoch."""
    num_optimizer_steps: int
    """Optimizer steps per epoch (windows; the last one may be short): set ``max_steps`` and LR
    schedules from it."""
    num_full_steps: int
    """Of those, the steps that reach ``effective_batch_size``."""
    last_step_micro_batches: int
    """Micro-batches in the epoch's last optimizer step (``gradient_accumulation_steps`` when it
    is full)."""
    last_effective_batch_size: int
    """Samples in the epoch's last optimizer step over all ranks; below the plan's
    ``effective_batch_size`` when the rows do not fill whole windows, and then every step's
    when the epoch cannot fill one window (``num_full_steps == 0``)."""

    @property
    def fills_every_step(self) -> bool:
        """Every optimizer step of the epoch reaches ``effective_batch_size``."""
        return self.num_full_steps == self.num_optimizer_steps

    def describe(self, effective_batch_size: int) -> str:
        """In words: what an epoch does under the plan."""
        steps = (
            f"an epoch is {self.num_micro_batches_per_rank} micro-batches per rank "
            f"({self.num_rows_per_rank} rows), {self.num_optimizer_steps} optimizer step(s)"
        )
        if self.fills_every_step:
            return f"{steps}, each of effective_batch_size {effective_batch_size}"
        if self.num_full_steps == 0:
            return (
                f"{steps}: the epoch cannot fill one window of the plan, so every step reaches "
                f"an effective batch of {self.last_effective_batch_size}, not "
                f"{effective_batch_size}"
            )
        return (
            f"{steps}: {self.num_full_steps} of effective_batch_size {effective_batch_size}, "
            f"then a last one of {self.last_effective_batch_size} samples "
            f"({self.last_step_micro_batches} micro-batch(es) per rank)"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> EpochPlan | None:
        """Inverse of :meth:`to_dict`; None stays None."""
        return None if data is None else cls(**data)


def epoch_plan(
    sizes: Sequence[int], world_size: int, data: Any, *, drop_last: bool = False
) -> EpochPlan:
    """One epoch of ``data`` in windows of micro-batches of ``sizes`` (a plan's
    ``micro_batch_sizes``), on each of ``world_size`` ranks.

    Args:
        sizes: the micro-batch sizes of one window, in order.
        world_size: data-parallel ranks, >= 1.
        data: the rows of one epoch over all ranks (an int: each rank reads
            ``ceil(rows / world_size)``, as a padding ``DistributedSampler`` gives it); or a
            sampler (``len()`` is this rank's rows); or a loader built at the plan's micro-batch
            size (its ``sampler``'s ``len()`` and its ``drop_last``).
        drop_last: with an int or a sampler, whether the loader drops an incomplete last
            micro-batch (a loader's own ``drop_last`` is used for a loader).

    Raises:
        ConfigError: rows that are not an int >= 0; an object without ``len()``; a loader whose
            ``batch_size`` is not the plan's micro-batch size.
    """
    size = sizes[0]
    if isinstance(data, bool):
        raise ConfigError(f"the rows of an epoch must be an int >= 0, got {data!r}")
    if isinstance(data, int):
        if data < 0:
            raise ConfigError(f"the rows of an epoch must be an int >= 0, got {data}")
        rows = math.ceil(data / world_size)
    elif hasattr(data, "sampler") and hasattr(data, "batch_size"):
        batch_size = data.batch_size
        if batch_size is not None and batch_size != size:
            raise ConfigError(
                f"the loader yields micro-batches of {batch_size} rows, but the plan's are "
                f"{size}; build it with batch_size=plan.micro_batch_size"
            )
        drop_last = bool(getattr(data, "drop_last", False))
        rows = _rows(data.sampler, "the loader's sampler")
    else:
        rows = _rows(data, f"a {type(data).__name__}")
    return _epoch(tuple(sizes), world_size, rows, drop_last=drop_last)


def _rows(sized: Any, what: str) -> int:
    try:
        rows = len(sized)
    except TypeError:
        raise ConfigError(
            f"{what} has no len(), so the rows of an epoch are unknown (an iterable dataset); "
            "pass the number of rows instead"
        ) from None
    return int(rows)


def _epoch(sizes: tuple[int, ...], world_size: int, rows: int, *, drop_last: bool) -> EpochPlan:
    per_window = sum(sizes)
    full, left = divmod(rows, per_window)
    extra_rows = extra = 0
    for micro in sizes:  # the last window's whole micro-batches, in the window's order
        if left - extra_rows < micro:
            break
        extra, extra_rows = extra + 1, extra_rows + micro
    if left > extra_rows and not drop_last:
        extra, extra_rows = extra + 1, left  # an incomplete last micro-batch
    steps = full + (1 if extra else 0)
    last_rows = extra_rows if extra else (per_window if full else 0)
    return EpochPlan(
        num_rows_per_rank=rows,
        drop_last=drop_last,
        num_micro_batches_per_rank=full * len(sizes) + extra,
        num_optimizer_steps=steps,
        num_full_steps=full,
        last_step_micro_batches=extra if extra else (len(sizes) if full else 0),
        last_effective_batch_size=last_rows * world_size,
    )
