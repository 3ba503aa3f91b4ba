"""One window of the Accumulator: its micro-steps, its optimizer step, and what that step did.

A :class:`Window` holds the micro-batches of one optimizer step, fetched and counted by
:meth:`Accumulator.windows <autobatch.training._accumulator.Accumulator.windows>`: iterate it
for :class:`~autobatch.training._micro_step.MicroStep` s (or let :meth:`Window.run` run them,
splitting a micro-batch that runs out of memory), then :meth:`Window.step` applies the window's
gradient once and returns its :class:`StepStats`. The Accumulator's settings (optimizer,
scaler, scheduler, clipping, the ranks' agreement) are read from the Accumulator that made it.

Example::

    for window in acc.windows(loader):
        for micro in window:
            micro.backward(model(**micro.batch).loss)
        stats = window.step()           # unscale, clip, step, update, schedule, zero
        float(stats.loss), stats.global_count
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

import torch
from torch.nn.utils import clip_grad_norm_

from autobatch.errors import ConfigError
from autobatch.training._micro_step import MicroStep, WindowState
from autobatch.training._oom_split import SplitEvent, run_window
from autobatch.training._window_agreement import Status

if TYPE_CHECKING:
    from autobatch.training._accumulator import Accumulator

__all__ = ["StepStats", "Window"]

B = TypeVar("B")

# Emitted by torch when scheduler.step() follows a GradScaler-skipped first optimizer step.
_SCHEDULER_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class StepStats:
    """What one window's optimizer step did. Tensors are detached and hold no graph.

    Attributes:
        grad_norm: 0-dim, detached: total 2-norm of the window's (unscaled) gradient before
            clipping, or ``None`` when ``max_grad_norm`` is not set.
        skipped: True when the GradScaler found inf/NaN and skipped the optimizer step.
        num_micro_steps: micro-batches in this window (``gradient_accumulation_steps``, or
            fewer for the last).
        local_count: counted items (samples or tokens) in this rank's micro-batches of the
            window.
        global_count: counted items in the window over all ranks; the divisor of the mean.
        splits: micro-batches :meth:`Window.run` split after running out of memory, in order.
        micro_batch_size_limit: the largest piece :meth:`Window.run` runs after this window
            (rows), or ``None`` when micro-batches run whole, as planned.
    """

    __slots__ = (
        "_loss",
        "_loss_factor",
        "_weighted_losses",
        "global_count",
        "grad_norm",
        "local_count",
        "micro_batch_size_limit",
        "num_micro_steps",
        "skipped",
        "splits",
    )

    def __init__(
        self,
        *,
        weighted_losses: list[torch.Tensor],
        loss_factor: float,
        grad_norm: torch.Tensor | None,
        skipped: bool,
        local_count: int,
        global_count: int,
        num_micro_steps: int,
        splits: tuple[SplitEvent, ...] = (),
        micro_batch_size_limit: int | None = None,
    ) -> None:
        self._weighted_losses = weighted_losses
        self._loss_factor = loss_factor
        self._loss: torch.Tensor | None = None
        self.grad_norm = grad_norm
        self.skipped = skipped
        self.num_micro_steps = num_micro_steps
        self.local_count = local_count
        self.global_count = global_count
        self.splits = splits
        self.micro_batch_size_limit = micro_batch_size_limit

    @property
    def loss(self) -> torch.Tensor:
        """0-dim, detached, on the loss's device: mean loss over this rank's counted items in
        the window (under DDP each rank reports its own share; average with weights
        ``local_count`` for the global value).

        Summed on first access, so a loop that does not log pays nothing for it.
        ``float(stats.loss)`` forces a host sync; do it only when logging.
        """
        if self._loss is None:
            parts = self._weighted_losses
            total = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
            self._loss = total if self._loss_factor == 1.0 else total * self._loss_factor
        return self._loss

    def __repr__(self) -> str:
        return (
            f"StepStats(loss={self.loss!r}, grad_norm={self.grad_norm!r}, "
            f"skipped={self.skipped}, num_micro_steps={self.num_micro_steps}, "
            f"local_count={self.local_count}, global_count={self.global_count}, "
            f"splits={self.splits!r}, micro_batch_size_limit={self.micro_batch_size_limit})"
        )


class Window(Generic[B]):
    """The micro-batches of one optimizer step. Iterate it for
    :class:`~autobatch.training._micro_step.MicroStep` s, then call :meth:`step` once.

    Attributes:
        index: 0-based window number within one :meth:`Accumulator.windows` call.
        local_count: counted items in this rank's micro-batches.
        global_count: counted items over all ranks (all-reduced once per window under DDP).
    """

    def __init__(
        self,
        acc: Accumulator,
        batches: Sequence[B],
        counts: Sequence[int],
        index: int,
        global_count: int,
        count_fn: Callable[[B], int | torch.Tensor] | None = None,
        /,
    ) -> None:
        self._acc = acc
        self._state = state = WindowState(
            index=index,
            global_count=global_count,
            count_fn=count_fn,
            optimizer=acc.optimizer,
            scaler=acc.scaler,
            world_size=acc.world_size,
            parallel=acc._parallel,
            agreement=acc._agreement,
        )
        last = len(batches) - 1
        state.micro_steps = [
            MicroStep(state, batch, counts[i], i, i == last) for i, batch in enumerate(batches)
        ]
        self.index = index
        self.local_count = sum(counts)
        self.global_count = global_count
        self._splits: list[SplitEvent] = []

    def __iter__(self) -> Iterator[MicroStep[B]]:
        return iter(self._state.micro_steps)

    def __len__(self) -> int:
        return len(self._state.micro_steps)

    @property
    def pending_backward(self) -> bool:
        """Whether some backward ran in this window but :meth:`step` has not (and the window did
        not fail on a rank, which dropped its gradients)."""
        state = self._state
        return state.num_backward > 0 and not state.stepped and not state.abandoned

    def run(
        self,
        loss_of: Callable[[B], torch.Tensor],
        *,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> StepStats:
        """Run every micro-step's forward (``loss_of(batch) -> loss``) and weighted backward,
        then :meth:`step`; with ``on_oom="split"`` split a micro-batch that runs out of memory.

        Returns:
            The window's :class:`StepStats`, ``splits`` and ``micro_batch_size_limit`` included.

        Arguments and errors: :func:`autobatch.training._oom_split.run_window`; and :meth:`step`'s.
        Under DDP an error on one rank reaches the others at the next agreement, where they raise
        ``DistributedError``; without splitting, an error in ``loss_of`` does only where the
        ranks agree before the synchronised backward and this rank can still meet them there
        (its last micro-step, or a forward pass that does not communicate).
        """
        acc, state = self._acc, self._state
        num_forward = [0]
        if state.agrees and acc._splitter.on_oom == "split":
            state.agrees = state.sync_due = False  # splitting agrees once per micro-step
        elif state.agrees:  # whole micro-batches, in order: count them to know which failed
            user_loss_of = loss_of

            def loss_of(batch: B) -> torch.Tensor:
                num_forward[0] += 1
                return user_loss_of(batch)

        try:
            self._splits = run_window(
                state, loss_of, reduction=reduction, model=acc.model, splitter=acc._splitter
            )
        except Exception:
            if acc._agreement is not None:
                acc._agreement.run_failed(
                    state,
                    num_forward[0] - 1,
                    splitting=acc._splitter.on_oom == "split",
                    forward_communicates=acc._forward_communicates(),
                )
            raise
        return self.step()

    def step(self) -> StepStats:
        """Apply the window's gradient: unscale, clip, optimizer step, scaler update, scheduler
        step, zero grads (to ``None``).

        The scheduler steps every window, also when the GradScaler skipped the optimizer step
        (inf/NaN), so the schedule counts windows of data seen; torch's "scheduler.step() before
        optimizer.step()" warning for a skipped first step is suppressed for that reason.

        Returns:
            The window's :class:`StepStats`.

        Raises:
            ConfigError: called twice, or before every micro-step of the window ran backward.
                Under DDP this and any other error here (the optimizer's, the scaler's, the
                scheduler's) reaches the other ranks at the next agreement (the next window's
                count, or the end of the micro-batches), where they raise ``DistributedError``.
        """
        try:
            return self._step()
        except Exception:
            self._state.tell_failure(Status.STEP)
            raise

    def _step(self) -> StepStats:
        state = self._state
        if state.abandoned:
            raise ConfigError(state.repeated_backward_message(0, False))
        if state.stepped:
            raise ConfigError(f"window {self.index} already stepped; call window.step() once")
        if state.num_backward != state.num_micro_steps:
            raise ConfigError(
                f"window {self.index} has {state.num_micro_steps} micro-steps but backward ran "
                f"for {state.num_backward}; call micro.backward(loss) for every micro-step first"
            )
        state.stepped = True
        acc = self._acc
        optimizer, scaler = acc.optimizer, acc.scaler
        grad_norm: torch.Tensor | None = None
        skipped = False
        try:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if acc.max_grad_norm is not None:
                grad_norm = clip_grad_norm_(acc._params(), acc.max_grad_norm)
            if scaler is not None:
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                skipped = scaler.get_scale() < scale_before
            else:
                optimizer.step()
            if acc.scheduler is not None and skipped:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", _SCHEDULER_ORDER_WARNING, UserWarning)
                    acc.scheduler.step()
            elif acc.scheduler is not None:
                acc.scheduler.step()
        finally:
            # Also when a step above raised: the window's gradient must not reach the next one
            # (every backward ran, the last one reducing: FSDP2 keeps nothing unsharded).
            state.drop_gradients(pending=False)
        # The weighted losses sum to this rank's loss sum * world_size / global_count; under
        # DDP the factor rescales that to this rank's own mean.
        world_size = acc.world_size
        factor = (
            1.0 if world_size == 1 else self.global_count / (world_size * max(self.local_count, 1))
        )
        return StepStats(
            weighted_losses=state.weighted_losses,
            loss_factor=factor,
            grad_norm=grad_norm,
            skipped=skipped,
            local_count=self.local_count,
            global_count=self.global_count,
            num_micro_steps=state.num_micro_steps,
            splits=tuple(self._splits),
            micro_batch_size_limit=acc._splitter.limit,
        )
