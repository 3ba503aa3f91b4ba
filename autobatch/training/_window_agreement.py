"""The window agreement: the Accumulator's agreements under DistributedDataParallel, by which an
error on one rank reaches the others instead of leaving them waiting in a collective.

(Not the probe's consensus, :mod:`autobatch.distributed._consensus`, which makes the ranks of a
probe try the same sizes; nor the limit agreement, :mod:`autobatch.training._limit_agreement`,
which makes them split a micro-batch together with ``on_oom="split"``.)

Every window agreement is the same small collective: a SUM all-reduce of ``world_size + 2`` int64
values: this rank's counted items, whether it has a micro-batch counting 0 items, and one status
per rank (0 on every rank that is fine). The ranks meet at one for each window's count (in
``Accumulator.windows``: the count all-reduce each window always had) and one when the
micro-batches run out (once per loop); and, only in a window where some rank has a micro-batch
counting 0 items (where a "mean" loss is refused, on that rank only), one before the window's
synchronised backward (the last micro-step's ``backward``; with ``on_oom="split"``, the limit
agreements instead). A rank that fails meets the others at the next window agreement with its
status and then raises its own error; each of the others raises :class:`DistributedError` there,
naming the rank and what failed. No rank leaves an agreement alone, so the ranks stay in step.

Uneven shards (a streaming dataset whose ranks hold different numbers of micro-batches): when
some rank's micro-batches run out at a window's count agreement, every rank stops there, after
the same optimizer step; the ranks that still had micro-batches leave that window untrained, and
each rank says what was left (an :class:`UnevenStop`, logged as a WARNING on the ``autobatch``
logger and kept on the Accumulator's ``uneven_stop``).
Every agreement but a loop's first has a deadline (:mod:`autobatch.distributed._deadline`): a rank
that stops answering fails the others within a few window-times, naming it.

Example::

    agreement = WindowAgreement(process_group, ddp_model)
    global_count, empty = agreement.meet(local_count, where="the count agreement of window 3")
    agreement.meet(0, where="...", status=Status.STEP, window=3)  # failed: tell, then raise
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Protocol

import torch
import torch.distributed as dist

from autobatch.distributed import AgreementDeadline, Agreements
from autobatch.errors import ConfigError, DistributedError

__all__ = ["AgreeingWindow", "Status", "UnevenStop", "WindowAgreement"]

logger = logging.getLogger("autobatch")


class Status(enum.IntEnum):
    """What a rank brings to an agreement."""

    OK = 0
    FETCH = 1
    """An error fetching or counting the window's micro-batches (the loader, ``count_fn``)."""
    BACKWARD = 2
    """A micro-step's backward refused (a ConfigError, e.g. a mean loss over 0 counted items)."""
    STEP = 3
    """An error in ``window.step()`` (the optimizer, scaler, scheduler, or its own checks)."""
    RUN = 4
    """An error in ``Window.run`` (the user's ``loss_of``, a backward)."""
    EXHAUSTED = 5
    """The rank's micro-batches ran out."""


_WHAT = {
    Status.FETCH: "raised an error while fetching or counting its micro-batches for window {w}",
    Status.BACKWARD: "refused the backward of a micro-step of window {w}",
    Status.STEP: "raised an error in window.step() of window {w}",
    Status.RUN: "raised an error in Window.run of window {w}",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnevenStop:
    """Where the ranks stopped together because some rank's micro-batches ran out, and what was
    left untrained."""

    window_index: int
    """The window no rank trained: every rank made ``window_index`` optimizer steps."""
    exhausted_ranks: tuple[int, ...]
    """The ranks whose micro-batches ran out before this window."""
    rank: int
    """This rank."""
    num_untrained_micro_batches: int
    """This rank's micro-batches fetched for the window and not trained (0 on a rank that ran
    out); any still in its iterable after them were not fetched."""
    num_untrained_items: int
    """Counted items of the window's micro-batches, summed over the ranks that had some."""

    def describe(self) -> str:
        """The stop in words, with its numbers."""
        ran_out = ", ".join(str(rank) for rank in self.exhausted_ranks)
        return (
            f"rank{'s' if len(self.exhausted_ranks) > 1 else ''} {ran_out} ran out of "
            f"micro-batches after {self.window_index} window(s): every rank stopped after "
            f"{self.window_index} optimizer step(s) (uneven shards); rank {self.rank} leaves "
            f"{self.num_untrained_micro_batches} micro-batch(es) of window {self.window_index} "
            f"untrained ({self.num_untrained_items} counted items over all ranks), and any after "
            "them in its iterable; give every rank the same number of micro-batches "
            "(DistributedSampler, drop_last=True) to train them all"
        )


class AgreeingWindow(Protocol):
    """What the window agreement uses of a window: its
    :class:`~autobatch.training._micro_step.WindowState` (that module imports this one, never the
    other way round)."""

    sync_due: bool
    """Whether this rank meets the others before the synchronised backward (still to come)."""
    synced: bool
    """Whether the synchronised backward ran on this rank."""
    abandoned: bool
    """Whether the ranks agreed that the window failed (its gradients are dropped)."""
    failed_after_agreements: bool
    """Set by ``run_window`` (splitting) for an error after the ranks' last agreement."""

    @property
    def index(self) -> int: ...
    @property
    def num_micro_steps(self) -> int: ...
    def abandon(self) -> None: ...


class WindowAgreement:
    """The window agreements of one Accumulator's ranks (see the module docstring).

    Args:
        group: the data-parallel process group (the ``DistributedDataParallel`` model's, or the
            one an FSDP2 model reduces its gradients over).
        model: the model; the all-reduced tensor lives on its parameters' device (NCCL needs
            CUDA).
        deadline: how long each agreement but a loop's first waits for a peer; None: the
            process group's own timeout (:mod:`autobatch.distributed._deadline`).
    """

    __slots__ = ("agreements", "group", "model", "rank", "ran_out", "told_at_next", "world_size")

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        model: torch.nn.Module,
        deadline: AgreementDeadline | None = None,
    ) -> None:
        self.group = group
        self.model = model
        self.agreements = Agreements(group, deadline)
        """Every agreement of the Accumulator's ranks, the limit agreements' too."""
        self.told_at_next: int | None = None
        """The window whose error this rank told the others at the agreement that starts the
        next window (or ends the loop): the loop cannot go on (``windows()`` resets it)."""
        self.ran_out: tuple[int, ...] = ()
        """The ranks whose micro-batches had run out at the latest agreement, when others' had
        not (the ranks stop together there); empty otherwise."""
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def meet(
        self,
        count: int,
        *,
        where: str,
        status: Status = Status.OK,
        window: int = 0,
        empty: bool = False,
    ) -> tuple[int, bool]:
        """Meet the other ranks at the next window agreement.

        Args:
            count: this rank's counted items (0 unless ``where`` is a window's count).
            where: the agreement, for this rank's message ("the count agreement of window 3").
            status: this rank's; not ``OK`` when it failed and raises its own error next.
            window: the window this rank failed at, or, with ``EXHAUSTED``, the number of
                windows it yielded (named in the other ranks' messages).
            empty: whether a micro-batch of this rank's window counts 0 items.

        Returns:
            The counted items summed over the ranks, and whether a micro-batch of some rank
            counts 0 items.

        Raises:
            DistributedError: another rank failed (not raised on a rank that failed itself: it
                raises its own error).
        """
        device = next(self.model.parameters()).device
        values = torch.zeros(self.world_size + 2, dtype=torch.int64, device=device)
        values[0] = count
        values[1] = int(empty)
        if status != Status.OK:
            values[2 + self.rank] = (int(status) << 32) + window
        self.agreements.all_reduce(values, dist.ReduceOp.SUM, where=where or "an agreement")
        total, num_empty, *slots = values.tolist()
        agreed = int(total), num_empty > 0
        self.ran_out = ()
        if not any(slots) or status not in (Status.OK, Status.EXHAUSTED):
            return agreed  # all is well, or this rank raises its own error
        reported = [
            (rank, Status(slot >> 32), slot & 0xFFFFFFFF) for rank, slot in enumerate(slots)
        ]
        for rank, code, at in reported:
            if code not in (Status.OK, Status.EXHAUSTED):
                what = _WHAT[code].format(w=at)
                raise DistributedError(
                    f"rank {rank} {what} (see that rank's error); this rank stops too, at "
                    f"{where}, so that no rank waits for it in a collective"
                )
        exhausted = tuple(rank for rank, code, _ in reported if code == Status.EXHAUSTED)
        if len(exhausted) < self.world_size:
            self.ran_out = exhausted  # some ranks ran out, others had a window: all stop here
        return agreed

    def uneven_stop(
        self, window_index: int, num_micro_batches: int, num_items: int
    ) -> UnevenStop | None:
        """After the agreement at window ``window_index``'s count (or the end of this rank's
        micro-batches): the stop, logged, when some ranks ran out there and others had this
        window (``num_micro_batches`` of this rank's, ``num_items`` counted over all ranks);
        None when the ranks are even."""
        if not self.ran_out:
            return None
        stop = UnevenStop(
            window_index=window_index,
            exhausted_ranks=self.ran_out,
            rank=self.rank,
            num_untrained_micro_batches=num_micro_batches,
            num_untrained_items=num_items,
        )
        logger.warning("%s", stop.describe())
        return stop

    # -- an error on this rank: the others learn of it at the next agreement ------------------

    def tell(self, status: Status, window_index: int) -> None:
        """Meet the others at the next agreement with this rank's failure (it raises next)."""
        try:
            self.meet(
                0,
                where=f"the agreement where this rank tells of its error in window {window_index}",
                status=status,
                window=window_index,
            )
        except Exception:  # noqa: BLE001 - a broken group: this rank's own error matters more
            logger.warning("could not tell the other ranks of this rank's error", exc_info=True)

    def failed(self, window: AgreeingWindow, status: Status) -> None:
        """This rank raises an error in ``window`` next: meet the others at the agreement they
        wait at, before the window's synchronised backward or at the next window's count."""
        if window.abandoned:
            return  # they know already
        if window.sync_due:
            window.sync_due = False
            self.tell(status, window.index)
            window.abandon()
        elif window.synced and self.told_at_next is None:
            # Past the synchronised backward (before it, the others may be in its all-reduce).
            self.tell(status, window.index)
            self.told_at_next = window.index

    def before_synchronised_backward(
        self, window: AgreeingWindow, error: ConfigError | None
    ) -> None:
        """The agreement before ``window``'s synchronised backward, with this rank's refused
        backward (``error``) if any.

        Raises:
            ConfigError: ``error``, on this rank (the window's gradients are dropped).
            DistributedError: another rank refused (the window's gradients are dropped).
        """
        window.sync_due = False
        try:
            self.meet(
                0,
                where=f"the agreement before the synchronised backward of window {window.index}",
                status=Status.OK if error is None else Status.BACKWARD,
                window=window.index,
            )
        except DistributedError:
            window.abandon()
            raise
        if error is not None:
            window.abandon()
            raise error

    def run_failed(
        self, window: AgreeingWindow, failing: int, *, splitting: bool, forward_communicates: bool
    ) -> None:
        """``Window.run`` raised (in micro-step ``failing`` when not ``splitting``): tell the
        others where they can still be met."""
        if window.abandoned:
            return
        if splitting:
            if window.failed_after_agreements:  # splitting told them of anything earlier
                self.failed(window, Status.RUN)
        elif window.sync_due and (
            failing == window.num_micro_steps - 1 or not forward_communicates
        ):
            # An error in micro-step `failing` (loss_of, or autograd): the others go on to the
            # agreement before the synchronised backward after their forward passes, which this
            # rank can no longer keep in step with when they communicate.
            self.failed(window, Status.RUN)
        # Else it failed inside the synchronised backward (the others are in its all-reduce),
        # or where they cannot be met: they fail when this process ends.
