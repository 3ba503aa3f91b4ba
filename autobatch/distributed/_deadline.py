"""A deadline for the ranks' agreements: a peer that stops answering (hung in its step, stopped
in a debugger, dead) fails the others within a few step-times, naming it, instead of leaving them
in the agreement until the process group's timeout (10 to 30 minutes by default).

Every agreement of the probe (:class:`autobatch.distributed._consensus.ProcessGroupConsensus`)
and of the Accumulator (:mod:`autobatch.training._window_agreement`,
:mod:`autobatch.training._limit_agreement`) goes through one :class:`Agreements` per party. Each
agreement's collective carries its own timeout (gloo and NCCL take one per collective), of

    ``max(deadline.min_seconds, deadline.step_multiple * seconds since this rank's previous
    agreement ended)``

so a slow step on every rank stretches it (the peers do the same work), while a rank that never
comes is noticed after ``min_seconds`` (default :data:`DEFAULT_MIN_SECONDS`, or the environment
variable :data:`MIN_SECONDS_ENV`) or ``step_multiple`` (default :data:`DEFAULT_STEP_MULTIPLE`)
times this rank's own work, whichever is longer; never after the process group's own timeout
(read from its backends): an agreement waits at most that timeout less :func:`group_margin`, so
that it fails first, naming the late rank, where the group's watchdog would end the job without
a word (a job's ``init_process_group(timeout=60 s)`` caps the 120 s floor at 55 s). A party's
first agreement (the probe's first,
the first of each ``Accumulator.windows()`` loop) follows arbitrary code of the user's (loading a
model, an evaluation, a checkpoint that rank 0 alone writes), so it keeps the process group's own
timeout. ``deadline=None`` keeps it for every agreement.

Before each agreement a rank writes how many it has reached to the process group's store (one
small write; best effort), so the ranks that time out can name the ones that never came. After a
timeout the group's connections are closed (gloo), so a late peer fails at once too: the job is
over, and the error says which rank to look at.

Example::

    agreements = Agreements(group, AgreementDeadline(min_seconds=60, step_multiple=10))
    agreements.all_reduce(values, dist.ReduceOp.SUM, where="the count agreement of window 3")
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import itertools
import math
import os
import re
import time
from typing import Any

import torch
import torch.distributed as dist

from autobatch.errors import ConfigError, DistributedError

__all__ = [
    "DEFAULT_MIN_SECONDS",
    "DEFAULT_STEP_MULTIPLE",
    "MIN_SECONDS_ENV",
    "AgreementDeadline",
    "Agreements",
    "Default",
    "group_margin",
    "group_timeout_seconds",
    "resolve_deadline",
]

DEFAULT_MIN_SECONDS = 120.0
"""Seconds an agreement waits for a peer at least (when ``AUTOBATCH_AGREEMENT_SECONDS`` is not
set): long enough for a data loader's stall, a garbage collection, a short log or evaluation on
one rank; far below the process groups' own timeouts."""

DEFAULT_STEP_MULTIPLE = 10.0
"""An agreement waits at least this many times what this rank did since its previous one."""

MIN_SECONDS_ENV = "AUTOBATCH_AGREEMENT_SECONDS"
"""Environment variable that sets :attr:`AgreementDeadline.min_seconds`'s default (seconds, > 0):
for ``autotune``, whose consensus is built for you, and every Accumulator of the process."""


def _min_seconds_default() -> float:
    text = os.environ.get(MIN_SECONDS_ENV)
    if text is None:
        return DEFAULT_MIN_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{MIN_SECONDS_ENV}={text!r} must be a number of seconds > 0, e.g. 120 (how long an "
            "agreement of the ranks waits for a peer at least)"
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgreementDeadline:
    """How long an agreement of the ranks waits for a peer: ``max(min_seconds, step_multiple *
    seconds this rank spent since its previous agreement)``.

    Raises:
        ConfigError: a value that is not a finite number > 0 (``step_multiple`` >= 1).
    """

    min_seconds: float = dataclasses.field(default_factory=_min_seconds_default)
    """Seconds waited at least (default :data:`DEFAULT_MIN_SECONDS`, or
    ``$AUTOBATCH_AGREEMENT_SECONDS``)."""
    step_multiple: float = DEFAULT_STEP_MULTIPLE
    """Times this rank's own work since its previous agreement that a peer may take, >= 1."""

    def __post_init__(self) -> None:
        for name, value, least in (
            ("min_seconds", self.min_seconds, 0.0),
            ("step_multiple", self.step_multiple, 1.0),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < least
                or value <= 0
            ):
                raise ConfigError(
                    f"AgreementDeadline {name}={value!r} must be a finite number "
                    f"{'> 0' if least == 0 else '>= 1'}"
                )

    def seconds(self, work_seconds: float) -> float:
        """The deadline of an agreement that follows ``work_seconds`` of this rank's work."""
        return max(self.min_seconds, self.step_multiple * work_seconds)


class Default(enum.Enum):
    """The default of a ``deadline=`` argument: :class:`AgreementDeadline`'s defaults, read
    when the party is built (``$AUTOBATCH_AGREEMENT_SECONDS`` included)."""

    DEADLINE = "default"


def resolve_deadline(deadline: AgreementDeadline | Default | None) -> AgreementDeadline | None:
    """A ``deadline=`` argument as the deadline to use (None: the process group's timeout).

    Raises:
        ConfigError: not an AgreementDeadline or None; ``$AUTOBATCH_AGREEMENT_SECONDS`` invalid.
    """
    if deadline is Default.DEADLINE:
        return AgreementDeadline()
    if deadline is not None and not isinstance(deadline, AgreementDeadline):
        raise ConfigError(
            f"deadline {deadline!r} must be an AgreementDeadline (from autobatch.distributed), "
            "or None to wait until the process group's own timeout"
        )
    return deadline


_INSTANCES = itertools.count()
"""Numbers the parties of a process, so that the same party has the same store keys on every
rank (ranks create their consensus and Accumulators in the same order)."""


class Agreements:
    """One party's agreements over a process group, each with its deadline (module docstring).

    Args:
        group: the process group; None for the default one.
        deadline: how long each agreement waits; None: the process group's own timeout.
        device: where the tensors it sends live (the CPU for gloo, a CUDA device for NCCL).
    """

    __slots__ = (
        "_count",
        "_key",
        "_last",
        "_store",
        "cap_seconds",
        "deadline",
        "group",
        "rank",
        "world_size",
    )

    def __init__(self, group: dist.ProcessGroup | None, deadline: AgreementDeadline | None) -> None:
        self.group = group
        self.deadline = deadline
        timeout = group_timeout_seconds(group)
        self.cap_seconds = None if timeout is None else timeout - group_margin(timeout)
        """The longest an agreement with a deadline waits: the group's timeout less a margin,
        in seconds; None when the timeout cannot be read."""
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._count = 0
        self._last: float | None = None
        self._store: Any = _store_of(group)
        self._key = f"autobatch/agreements/{next(_INSTANCES)}/"

    def restart(self) -> None:
        """The next agreement follows the user's own code (a new loop): no deadline for it."""
        self._last = None

    def all_reduce(self, tensor: torch.Tensor, op: Any, *, where: str) -> None:
        """``dist.all_reduce(tensor, op)`` over the group, within the deadline.

        Args:
            tensor: reduced in place.
            op: the reduction (``dist.ReduceOp.SUM``, ``MIN``...).
            where: the agreement in words, for the error ("the count agreement of window 3").

        Raises:
            DistributedError: a peer did not answer within the deadline, or the group failed
                (names the ranks that did not reach the agreement, when the store tells).
        """
        seconds = self._arrive()
        try:
            if seconds is None:
                dist.all_reduce(tensor, op=op, group=self.group)
            else:
                options = dist.AllreduceOptions()
                options.reduceOp = op
                options.timeout = datetime.timedelta(seconds=seconds)
                _process_group(self.group).allreduce([tensor], options).wait()
        except RuntimeError as exc:  # torch's DistBackendError is one
            raise self._unanswered(where, seconds, exc) from exc
        finally:
            self._last = time.monotonic()

    def broadcast(self, tensor: torch.Tensor, *, where: str) -> None:
        """``dist.broadcast(tensor)`` from the group's rank 0, within the deadline.

        Raises:
            DistributedError: as :meth:`all_reduce`.
        """
        seconds = self._arrive()
        try:
            if seconds is None:
                source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
                dist.broadcast(tensor, src=source, group=self.group)
            else:
                options = dist.BroadcastOptions()
                options.rootRank = 0
                options.rootTensor = 0
                options.timeout = datetime.timedelta(seconds=seconds)
                _process_group(self.group).broadcast([tensor], options).wait()
        except RuntimeError as exc:
            raise self._unanswered(where, seconds, exc) from exc
        finally:
            self._last = time.monotonic()

    def _arrive(self) -> float | None:
        """Count this agreement, say so in the store, and return its deadline in seconds."""
        self._count += 1
        if self._store is not None:
            try:
                self._store.set(f"{self._key}{self.rank}", str(self._count))
            except Exception:  # noqa: BLE001 - best effort: only the error's wording needs it
                self._store = None
        if self.deadline is None or self._last is None:
            return None
        seconds = self.deadline.seconds(time.monotonic() - self._last)
        return seconds if self.cap_seconds is None else min(seconds, self.cap_seconds)

    def missing(self) -> list[int] | None:
        """The ranks that have not reached this rank's latest agreement; None when the store
        cannot tell (a group without one, or it failed)."""
        store = self._store
        if store is None:
            return None
        late = []
        try:
            for rank in range(self.world_size):
                key = f"{self._key}{rank}"
                if not store.check([key]) or int(store.get(key)) < self._count:
                    late.append(rank)
        except Exception:  # noqa: BLE001 - the store itself may be gone with a dead peer
            return None
        return late

    def _unanswered(
        self, where: str, seconds: float | None, exc: BaseException
    ) -> DistributedError:
        text = str(exc).strip()
        first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else ""
        first = first or type(exc).__name__
        late = self.missing()
        if late is None and self.world_size == 2:
            late = [1 - self.rank]  # of two ranks, the other one
        waited = (
            f"within {seconds:.3g} s ({_how(self.deadline, seconds == self.cap_seconds)})"
            if seconds is not None
            else "before the process group's timeout"
        )
        remedy = (
            f"This rank stops too. To wait longer, set ${MIN_SECONDS_ENV} or pass "
            "AgreementDeadline(min_seconds=...)"
        )
        if seconds is not None and seconds == self.cap_seconds:
            remedy = (
                "This rank stops too. To wait longer, give the process group a longer timeout "
                "(init_process_group(timeout=...))"
            )
        if late == []:  # every rank came: one gave up waiting (its deadline), or died there
            return DistributedError(
                f"{where} failed on rank {self.rank} after every rank reached it ({first}): "
                "another rank gave up waiting there (its deadline passed while this rank was "
                f"late) or ended; see the other ranks' errors. {remedy}"
            )
        who = "another rank"
        if late:
            who = f"rank{'s' if len(late) > 1 else ''} {', '.join(str(rank) for rank in late)}"
        return DistributedError(
            f"{who} did not reach {where} {waited} (rank {self.rank} waited there: {first}); "
            f"look at its output: a step that hangs, a process stopped or killed. {remedy}"
        )


def _how(deadline: AgreementDeadline | None, capped: bool) -> str:
    assert deadline is not None
    cap = ", capped at the process group's own timeout less a margin" if capped else ""
    return (
        f"the longer of {deadline.min_seconds:g} s and {deadline.step_multiple:g} times this "
        f"rank's own work since the previous agreement{cap}"
    )


def group_margin(timeout_seconds: float) -> float:
    """Seconds an agreement leaves before the group's timeout of ``timeout_seconds``: a tenth
    of it, at most 5 s (time for this rank to fail first and say which rank was late)."""
    return min(5.0, timeout_seconds / 10)


def group_timeout_seconds(group: dist.ProcessGroup | None) -> float | None:
    """The timeout of ``group``'s collectives (the ``timeout`` given to ``init_process_group``
    or ``new_group``, else the backend's default), in seconds: the smallest of its backends'
    (gloo for the CPU, NCCL for CUDA); None when none can be read.

    Read as ``torch.distributed``'s own ``_set_pg_timeout`` reaches the backends
    (``ProcessGroup._get_backend(device).options._timeout``): private, so a torch that moves it
    gives None (no cap), never an error.
    """
    try:
        pg = _process_group(group)
        timeouts = [
            pg._get_backend(device).options._timeout.total_seconds() for device in pg._device_types
        ]
    except Exception:  # noqa: BLE001 - a cap is a courtesy; the deadline works without one
        return None
    positive = [t for t in timeouts if isinstance(t, float) and t > 0]
    return min(positive) if positive else None


def _process_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)
    return world


def _store_of(group: dist.ProcessGroup | None) -> Any:
    """The c10d store of ``group`` (private c10d state: ``_world.pg_map``); None if unknown."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._world.pg_map[_process_group(group)][1]
    except Exception:  # noqa: BLE001 - naming the ranks is a courtesy, never a failure
        return None
