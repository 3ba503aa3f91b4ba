"""One window's micro-steps and the state they share: :class:`MicroStep` and :class:`WindowState`.

A :class:`~autobatch.training._window.Window` owns a :class:`WindowState`: its counts, the
weighted losses and backward passes so far, whether it stepped, and under DDP where it stands
with the ranks' window agreement. The window's :class:`MicroStep` s weight and run their backward
against it. It is also the seam to the two modules that run a window without being the window:
``Window.run``'s splitting (:func:`autobatch.training._oom_split.run_window`) and the window
agreement (:class:`autobatch.training._window_agreement.WindowAgreement`) read and change a window
only through the public names of :class:`WindowState` and of this module.

Example::

    for window in acc.windows(loader):       # each Window holds its WindowState
        for micro in window:                 # and yields its MicroSteps
            with micro.sync_context():
                micro.backward(model(**micro.batch).loss)
        window.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from autobatch.distributed import DataParallel
from autobatch.errors import ConfigError
from autobatch.training._window_agreement import Status, WindowAgreement

__all__ = ["MicroStep", "WindowState", "check_backward"]

B = TypeVar("B")

# Re-entrant and reusable: the sync context of every micro-step that needs none.
_NO_CONTEXT = contextlib.nullcontext()


class WindowState:
    """What one window has done so far, and what of its Accumulator its micro-steps use.

    Args:
        index: 0-based window number within one ``Accumulator.windows`` call.
        global_count: counted items over all ranks, > 0.
        count_fn: the ``count_fn`` the window's micro-batches were counted with, or None.
        optimizer: the Accumulator's optimizer (its gradients are dropped through it).
        scaler: the Accumulator's ``GradScaler``, or None.
        world_size: ranks of the data-parallel group (1 without DDP or FSDP2).
        parallel: the model's data-parallel gradient reduction (DDP, FSDP2), else None.
        agreement: the Accumulator's window agreement under DDP or FSDP2, else None.
    """

    __slots__ = (
        "abandoned",
        "agreement",
        "agrees",
        "count_fn",
        "ddp",
        "deferred",
        "failed_after_agreements",
        "global_count",
        "index",
        "micro_steps",
        "num_backward",
        "optimizer",
        "parallel",
        "scaler",
        "stepped",
        "sync_due",
        "synced",
        "weighted_losses",
        "world_size",
    )

    def __init__(
        self,
        *,
        index: int,
        global_count: int,
        count_fn: Callable[[Any], int | torch.Tensor] | None,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        world_size: int,
        parallel: DataParallel | None,
        agreement: WindowAgreement | None,
    ) -> None:
        self.index = index
        self.global_count = global_count
        self.count_fn = count_fn
        self.optimizer = optimizer
        self.scaler = scaler
        self.world_size = world_size
        self.parallel = parallel
        self.ddp: DistributedDataParallel | None = None if parallel is None else parallel.ddp
        self.agreement = agreement
        self.micro_steps: list[MicroStep[Any]] = []
        """The window's micro-steps, in order (the Window adds them)."""
        self.num_backward = 0
        """Backward passes run (a micro-step's, or a piece's while ``Window.run`` splits)."""
        self.weighted_losses: list[torch.Tensor] = []
        """Each backward's weighted loss, detached."""
        self.stepped = False
        """Whether ``window.step()`` began."""
        # Under DDP: whether this window's micro-steps meet at a window agreement before the
        # synchronised backward (not when Window.run splits: the limit agreements do instead),
        # whether that agreement is still to come (windows() sets it where some rank has a
        # micro-batch counting 0 items), the error kept for it, whether the synchronised
        # backward ran on this rank, and whether the ranks agreed that the window failed (its
        # gradients were dropped on every rank).
        self.agrees = agreement is not None
        self.sync_due = False
        self.deferred: ConfigError | None = None
        self.synced = False
        self.abandoned = False
        self.failed_after_agreements = False
        """Set by ``run_window`` (splitting) for an error after the ranks' last agreement of
        the window: the window agreement tells the others at the next window's."""

    @property
    def num_micro_steps(self) -> int:
        return len(self.micro_steps)

    def abandon(self) -> None:
        """The ranks agreed that this window failed: drop its gradients, so that a loop that
        catches the error on every rank skips the window."""
        self.abandoned = True
        self.drop_gradients()

    def drop_gradients(self, *, pending: bool = True) -> None:
        """Drop the window's gradients: the optimizer's, and (``pending``) under FSDP2 the
        unsharded ones its skipped reductions left (none after the window's last backward);
        the reduction is switched on again."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.parallel is not None:
            if pending:
                self.parallel.drop_pending()
            self.parallel.set_sync(True)

    def forget_backward(self) -> None:
        """Forget every backward of this window: its gradients, losses and counts."""
        self.drop_gradients()
        self.weighted_losses.clear()
        self.num_backward = 0
        for micro in self.micro_steps:
            micro._backward_done = False

    def mark_backward_done(self) -> None:
        """Every micro-step's backward ran (``Window.run`` ran them, perhaps in pieces)."""
        for micro in self.micro_steps:
            micro._backward_done = True
        self.num_backward = len(self.micro_steps)

    def tell_failure(self, status: Status) -> None:
        """This rank raises an error in this window next: under DDP, tell the other ranks at the
        window agreement they wait at."""
        if self.agreement is not None:
            self.agreement.failed(self, status)

    def repeated_backward_message(self, micro_index: int, backward_done: bool) -> str:
        if self.abandoned:
            return (
                f"window {self.index} failed on a rank and its gradients were dropped on every "
                "rank; catch the error and go on with the next window"
            )
        if backward_done:
            return (
                f"backward was already called for micro-step {micro_index} of window "
                f"{self.index}; call micro.backward(loss) exactly once per micro-step"
            )
        return f"window {self.index} has already stepped; run backward before window.step()"


class MicroStep(Generic[B]):
    """One micro-batch of a :class:`~autobatch.training._window.Window`: run its forward and
    backward inside :meth:`sync_context`, and hand the loss to :meth:`backward`.

    Attributes:
        batch: the micro-batch exactly as the loader produced it.
        count: counted items in it (from ``count_fn``), >= 0.
        index: position in the window, 0-based.
        is_last: whether this is the window's last micro-step (the one that synchronises).
    """

    __slots__ = ("_backward_done", "_state", "batch", "count", "index", "is_last")

    def __init__(self, state: WindowState, batch: B, count: int, index: int, is_last: bool, /):
        self._state = state
        self._backward_done = False
        self.batch = batch
        self.count = count
        self.index = index
        self.is_last = is_last

    def sync_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context for this micro-step's forward AND backward.

        Under DDP it is ``model.no_sync()`` except on the last micro-step, so gradients are
        all-reduced once per window; under FSDP2 it switches the reduce-scatter off
        (``set_requires_gradient_sync(False)``, on again on leaving) except on the last, which
        :meth:`backward` also does by itself; otherwise it does nothing.
        """
        parallel = self._state.parallel
        if parallel is None or self.is_last:
            return _NO_CONTEXT
        return parallel.skipped()

    def backward(self, loss: torch.Tensor, *, reduction: Literal["mean", "sum"] = "mean") -> None:
        """Weight the loss by this micro-batch's share of the window and backpropagate it.

        Args:
            loss: 0-dim tensor with a graph. With ``reduction="mean"`` it is the mean over this
                micro-batch's ``count`` counted items (what ``F.cross_entropy`` and Hugging Face
                ``.loss`` return); with ``"sum"`` it is their sum.
            reduction: how ``loss`` was reduced over the counted items.

        Raises:
            ConfigError: backward already called for this micro-step, or its window already
                stepped; ``reduction`` is neither ``"mean"`` nor ``"sum"``; a ``"mean"`` loss of
                a micro-batch with 0 counted items (that mean is NaN: return the sum and pass
                ``reduction="sum"``); a loss with more than one element; or, under DDP, a
                non-last micro-step run outside :meth:`sync_context`; its window failed on a
                rank (its gradients were dropped: go on with the next window). Under DDP such an
                error on a micro-step before the last is raised at the last one's ``backward``,
                where the ranks agree before the synchronised backward (until then this rank's
                forward passes keep in step with the others', and its backward does nothing):
                that agreement happens in a window where some rank has a micro-batch counting 0
                items, so a mean over 0 counted items on one rank makes every rank raise. Other
                refusals (program errors) are expected on every rank alike.
                An error from autograd itself (an OOM) propagates, and the micro-step's backward
                can then be retried.
            DistributedError: under DDP, another rank failed in this window (see its error);
                this window's gradients were dropped, as on that rank.
        """
        state = self._state
        if state.sync_due:  # under DDP, until the ranks agree before the synchronised backward
            checked = self._agreed_weight(loss, reduction)
            if checked is None:
                return  # an error kept for that agreement: this window runs no more backward
            loss, weight = checked
        else:
            try:
                loss, weight = check_backward(self, loss, reduction)
            except ConfigError:
                if state.agrees:  # after the agreement: the others learn of it at the next
                    state.tell_failure(Status.BACKWARD)
                raise
        weighted = loss * weight  # this micro-step's share of the global mean
        scaler = state.scaler
        if state.parallel is not None:  # FSDP2: reduce-scatter on the window's last only
            state.parallel.set_sync(self.is_last)
        torch.autograd.backward(scaler.scale(weighted) if scaler is not None else weighted)
        # Recorded only once backward succeeded: after an error (an OOM) the step can be retried.
        state.weighted_losses.append(weighted.detach())
        self._backward_done = True
        state.num_backward += 1
        if self.is_last:
            state.synced = True

    def _agreed_weight(
        self, loss: torch.Tensor, reduction: Literal["mean", "sum"]
    ) -> tuple[torch.Tensor, float] | None:
        """:func:`check_backward` under DDP before the agreement: an error on a micro-step before
        the last is kept (None: no backward); on the last, the ranks agree and every rank raises
        if one failed, before any of them enters the synchronised backward's all-reduce."""
        state = self._state
        error: ConfigError | None = None
        try:
            checked: tuple[torch.Tensor, float] | None = check_backward(self, loss, reduction)
        except ConfigError as exc:
            checked, error = None, exc
        if not self.is_last:
            if error is not None and state.deferred is None:
                state.deferred = error
            if state.deferred is None:
                return checked
            self._backward_done = True  # counted as run: the window fails at the last one
            state.num_backward += 1
            return None
        assert state.agreement is not None  # sync_due only under DDP
        state.agreement.before_synchronised_backward(state, state.deferred or error)
        return checked


def check_backward(
    step: MicroStep[Any], loss: torch.Tensor, reduction: Literal["mean", "sum"]
) -> tuple[torch.Tensor, float]:
    """:meth:`MicroStep.backward`'s checks: the loss as a 0-dim tensor and its weight, or the
    ConfigError backward would raise (``Window.run`` asks before the ranks' agreement)."""
    state = step._state
    if step._backward_done or state.stepped or state.abandoned:
        raise ConfigError(state.repeated_backward_message(step.index, step._backward_done))
    if reduction == "mean":
        if step.count == 0:
            raise ConfigError(
                f"micro-step {step.index} of window {state.index} has 0 counted items, so a "
                "mean loss is NaN; return the loss summed over counted items and call "
                "micro.backward(loss, reduction='sum')"
            )
        # A loss summed over counted items times world_size / global_count is this rank's
        # share of the global mean (DDP then averages over ranks); one division, so a lone
        # micro-step's weight is exactly 1.0.
        weight = step.count * state.world_size / state.global_count
    elif reduction == "sum":
        weight = state.world_size / state.global_count
    else:
        raise ConfigError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    ddp = state.ddp
    if ddp is not None and not step.is_last and ddp.require_backward_grad_sync:
        raise ConfigError(
            f"micro-step {step.index} of window {state.index} would all-reduce gradients "
            "under DDP; run its forward and backward inside `with micro.sync_context():`"
        )
    if loss.dim():  # one element of shape (1,) is accepted, and logged 0-dim
        if loss.numel() != 1:
            raise ConfigError(
                f"micro-step {step.index} of window {state.index} got a loss of shape "
                f"{tuple(loss.shape)}; pass one number: the mean (or, with reduction='sum', "
                "the sum) over this micro-batch's counted items"
            )
        loss = loss.reshape(())
    return loss, weight
