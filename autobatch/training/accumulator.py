"""Gradient accumulation that yields exactly the gradient of the effective batch.

Once a plan says "micro-batch m, k accumulation steps", the training loop runs k forward/backward
passes and one optimizer step per *window* of k micro-batches. :class:`Accumulator` does the
bookkeeping that is easy to get subtly wrong:

- each micro-batch's loss is weighted by its share of the counted items (samples, or non-padding
  tokens) in the whole window, all ranks included, so the accumulated gradient is the gradient of
  the mean over the effective batch even when micro-batches differ in size or padding;
- under ``DistributedDataParallel`` gradients are all-reduced once per window (``no_sync`` on the
  other micro-steps), and under FSDP2 (``fully_shard``) reduce-scattered once per window (its
  own ``set_requires_gradient_sync(False)`` on the other micro-steps), the counts summed over the
  data-parallel ranks either way;
- under DDP or FSDP2 an error on one rank only (``count_fn``, a refused backward, ``step``)
  reaches the other ranks at their next window agreement
  (:mod:`autobatch.training.window_agreement`), so every rank raises instead of waiting in a
  collective, and a rank that stops answering fails the others within a deadline
  (:mod:`autobatch.distributed.deadline`), naming it;
- the optimizer steps once per window, including a short last window, and gradients are zeroed
  after it, so nothing leaks into the next window or epoch;
- with a ``GradScaler``: scaled backward per micro-step, then once per window ``unscale_``,
  optional ``clip_grad_norm_`` over the whole window's gradient, ``step``, ``update``;
- an LR scheduler steps once per window.

Example::

    acc = Accumulator(model, optimizer, gradient_accumulation_steps=4,
                      scaler=scaler, scheduler=scheduler, max_grad_norm=1.0)
    for window in acc.windows(loader, count_fn=lambda b: int((b["labels"] != -100).sum())):
        for micro in window:
            with micro.sync_context():            # DDP: no all-reduce until the last micro-step
                loss = model(**micro.batch).loss  # mean over this micro-batch's counted tokens
                micro.backward(loss)              # weighted by count / window's total count
        stats = window.step()                     # unscale, clip, step, update, schedule, zero
        print(float(stats.loss), stats.global_count)

Or let the window run the passes itself, splitting a micro-batch that runs out of memory
(``Accumulator(..., on_oom="split")``, see :mod:`autobatch.training.oom_split`)::

    for window in acc.windows(loader):
        stats = window.run(lambda batch: model(**batch).loss)

The window's micro-batches are fetched from the loader before its first forward pass (k batches are
held at once), because the weights need the window's total count up front.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import clip_grad_norm_

from autobatch.distributed.deadline import AgreementDeadline, Default, resolve_deadline
from autobatch.errors import ConfigError, DistributedError, SmallMicroBatchNormWarning
from autobatch.planning import Plan
from autobatch.probing.conditions import check_plan_here, live_data_parallel
from autobatch.training.conditions import check_plan, loop_parallelism
from autobatch.training.counting import as_count, leading_dim
from autobatch.training.micro_step import MicroStep, WindowState
from autobatch.training.oom_split import (
    DEFAULT_OOM_RETRY_WINDOWS,
    OnOom,
    SplitEvent,
    Splitter,
    run_window,
)
from autobatch.training.window_agreement import Status, UnevenStop, WindowAgreement

__all__ = [
    "SMALL_MICRO_BATCH_FOR_BATCH_NORM",
    "Accumulator",
    "StepStats",
    "Window",
]

B = TypeVar("B")

SMALL_MICRO_BATCH_FOR_BATCH_NORM = 16
"""Below this many samples per micro-batch, BatchNorm statistics are noticeably unlike the
effective batch's, so :class:`SmallMicroBatchNormWarning` is emitted."""

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
    :class:`~autobatch.training.micro_step.MicroStep` s, then call :meth:`step` once.

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

        Arguments and errors: :func:`autobatch.training.oom_split.run_window`; and :meth:`step`'s.
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


class Accumulator:
    """Runs gradient accumulation so each optimizer step sees the effective batch's mean gradient.

    Args:
        model: the module being trained, possibly wrapped in ``DistributedDataParallel`` or
            sharded with FSDP2 (``fully_shard``), both detected: then counts are all-reduced
            over the ranks the gradients are averaged over (DDP's ``process_group``, the FSDP2
            mesh's group), ``world_size`` is their number, and the gradients are reduced once
            per window. FSDP1 and engines that own accumulation (DeepSpeed's) are refused.
        optimizer: steps once per window (a torch optimizer; an engine such as DeepSpeed's,
            which owns accumulation, is refused).
        gradient_accumulation_steps: micro-batches per optimizer step, >= 1; may be left out
            when ``plan`` is given.
        scaler: optional ``torch.amp.GradScaler``; losses are scaled before backward and
            unscaled once per window.
        scheduler: optional LR scheduler stepped (without arguments) once per window.
        max_grad_norm: optional clip of the window's total gradient 2-norm, > 0.
        on_oom: what :meth:`Window.run` does when a micro-batch runs out of memory: ``"raise"``
            (propagate it) or ``"split"`` (run it again in halves, gradient unchanged; see
            :mod:`autobatch.training.oom_split`). The manual ``for micro in window`` loop never
            splits.
        oom_retry_windows: with ``"split"``: windows run at the smaller size, without another
            out-of-memory error, before the planned size is tried again, >= 1.
        on_split: called with each :class:`~autobatch.training.oom_split.SplitEvent`, e.g.
            ``autobatch.tuning.split_recorder(...)`` so the profile store learns the size.
        plan: the plan this loop runs (``autotune``'s): its ``gradient_accumulation_steps``,
            checked against the loop: its world size must be the model's data-parallel ranks,
            and, where the loop skips the gradient reduction between micro-steps (DDP or FSDP2,
            more than one step), it must have been measured in that mode
            (``plan.gradient_sync``).
        agreement_deadline: under DDP or FSDP2, how long each agreement of the ranks but a
            loop's first waits for a peer
            (:class:`~autobatch.distributed.deadline.AgreementDeadline`; by default the longer
            of 120 s, or ``$AUTOBATCH_AGREEMENT_SECONDS``, and 10 times this rank's own work
            since its previous agreement); None: the process group's own timeout.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` not an int >= 1 (or neither it nor
            ``plan`` given), ``max_grad_norm`` not a finite number > 0, ``on_oom`` or
            ``oom_retry_windows`` invalid, a ``ReduceLROnPlateau`` scheduler (it needs a
            metric: step it yourself after ``window.step()``); the model or optimizer is an
            engine that owns accumulation, the model is sharded with FSDP1, or with FSDP2 and
            ``on_oom="split"``; a ``plan`` made for another loop (another world size or
            gradient-sync mode: :func:`autobatch.training.conditions.check_plan`,
            :func:`autobatch.probing.conditions.check_plan_here`).

    Warns:
        ConditionsWarning: the ``plan`` was measured under other conditions (each named).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        gradient_accumulation_steps: int | None = None,
        scaler: torch.amp.GradScaler | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        max_grad_norm: float | None = None,
        on_oom: OnOom = "raise",
        oom_retry_windows: int = DEFAULT_OOM_RETRY_WINDOWS,
        on_split: Callable[[SplitEvent], None] | None = None,
        plan: Plan | None = None,
        agreement_deadline: AgreementDeadline | Default | None = Default.DEADLINE,
    ) -> None:
        self._splitter = Splitter(on_oom=on_oom, retry_windows=oom_retry_windows, on_split=on_split)
        deadline = resolve_deadline(agreement_deadline)
        k = gradient_accumulation_steps
        if k is None and plan is None:
            raise ConfigError(
                "gradient_accumulation_steps must be an int >= 1, got None; pass the plan's "
                "gradient_accumulation_steps, or the plan itself (plan=...)"
            )
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"gradient_accumulation_steps must be an int >= 1, got {k!r}; pass the plan's "
                "gradient_accumulation_steps (1 means no accumulation), or plan=plan"
            )
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, int | float)
            or not math.isfinite(max_grad_norm)
            or max_grad_norm <= 0
        ):
            raise ConfigError(
                f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}; "
                "pass e.g. 1.0, or None to disable clipping"
            )
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "ReduceLROnPlateau steps on a metric, which the Accumulator does not have; pass "
                "scheduler=None and call scheduler.step(metric) yourself after window.step()"
            )
        self._parallel = parallel = loop_parallelism(model, optimizer, on_oom=on_oom)
        if plan is not None:
            k = check_plan(plan, gradient_accumulation_steps=k, parallel=parallel)
        assert k is not None
        self.model = model
        self.optimizer = optimizer
        self.gradient_accumulation_steps = k
        self.scaler = scaler
        self.scheduler = scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.plan = plan
        self._ddp = None if parallel is None else parallel.ddp
        self._group: dist.ProcessGroup | None = None
        self.world_size = 1
        """Data-parallel ranks: the group DDP or FSDP2 averages the gradients over; 1 without."""
        # The ranks' window agreements, under DDP or FSDP2.
        self._agreement: WindowAgreement | None = None
        if parallel is not None:
            self._group = parallel.group
            self.world_size = parallel.world_size
            self._agreement = WindowAgreement(self._group, model, deadline)
        if plan is not None:
            check_plan_here(
                plan,
                model,
                optimizer,
                where="Accumulator",
                data_parallel=self._data_parallel(),
            )
        self.uneven_stop: UnevenStop | None = None
        """Under DDP or FSDP2, where the latest ``windows()`` loop stopped because some rank's
        micro-batches ran out before the others' (uneven shards), and what it left untrained;
        None when every rank's ran out together."""
        # Checked once, on the first window: done already when there is no BatchNorm at all.
        self._norm_checked = not any(isinstance(m, _BatchNorm) for m in model.modules())

    def _data_parallel(self) -> tuple[int, str] | None:
        """This loop's data-parallel ranks and where that comes from; None when it cannot tell
        (torch.distributed without DDP or FSDP2: tensor-parallel ranks are not all
        data-parallel)."""
        if self._parallel is not None:
            return self.world_size, f"{self._parallel.wrapper}'s process group"
        if dist.is_available() and dist.is_initialized():
            return None
        return live_data_parallel()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def windows(
        self,
        micro_batches: Iterable[B],
        *,
        count_fn: Callable[[B], int | torch.Tensor] | None = None,
    ) -> Iterator[Window[B]]:
        """Group micro-batches into windows of ``gradient_accumulation_steps``.

        Each window is fetched whole before it is yielded; the last one of the iterable may be
        shorter and is weighted by its real size. Under DDP the ranks agree once at each
        window's start (its count all-reduce) and once when the micro-batches run out; when
        some rank's run out before the others' (uneven shards), every rank stops there, after
        the same optimizer step, and what was left untrained is logged and kept on
        :attr:`uneven_stop` (``DistributedSampler`` with ``drop_last=True`` evens them). An
        error on one rank (fetching, counting, a check, the previous window's ``step``) is
        taken to that agreement, so every rank raises instead of waiting in it. The optimizer's
        gradients are zeroed (to ``None``) when the loop starts, so nothing left by an earlier
        loop that broke off after a backward is added in.

        Args:
            micro_batches: one epoch of micro-batches, e.g. a ``DataLoader``.
            count_fn: counted items in a micro-batch (e.g. non-padding tokens), an int (or
                NumPy integer) or a one-element integer tensor (prefer counting on the host
                copy: a device tensor costs a sync). Default: the dim-0 size of the first tensor
                in the batch (a tensor, or a tuple/list/mapping of tensors, searched depth
                first). A list of samples (``collate_fn=list``) is refused, not miscounted:
                pass ``count_fn`` for it.

        Yields:
            :class:`Window` s, each to be iterated and then ``step()``-ed.

        Raises:
            ConfigError: a window's total count over all ranks is 0; ``count_fn`` returned a
                negative or non-integer value; the default count found no tensor in a batch;
                the previous window was not stepped before the next was requested.
            DistributedError: under DDP, another rank raised an error (see its error), or
                this loop goes on after this rank's error was reported to the others.
        """
        iterator = iter(micro_batches)
        # Start from no gradient: none left by an earlier loop that broke off after a backward
        # (an OOM retry, a `break`), or by a backward outside the helper.
        self.optimizer.zero_grad(set_to_none=True)
        if self._parallel is not None:
            self._parallel.drop_pending()
        agreement = self._agreement
        self.uneven_stop = None
        if agreement is not None:
            agreement.told_at_next = None
            agreement.agreements.restart()  # the loop's first agreement follows the user's code
        try:
            yield from self._windows(iterator, count_fn)
        finally:  # FSDP2: the reduction on again, also when the loop broke off mid-window
            if self._parallel is not None:
                self._parallel.set_sync(True)

    def _windows(
        self,
        iterator: Iterator[B],
        count_fn: Callable[[B], int | torch.Tensor] | None,
    ) -> Iterator[Window[B]]:
        agreement = self._agreement
        previous: Window[B] | None = None
        for index in itertools.count():
            if agreement is not None and agreement.told_at_next is not None:
                raise DistributedError(
                    f"window {agreement.told_at_next}'s error on this rank was reported to the "
                    "other ranks at the agreement that starts the next window, where they "
                    "stopped; start a new windows() loop on every rank to go on"
                )
            try:
                batches, counts = self._fetch(iterator, previous, index, count_fn)
            except Exception:
                if agreement is not None:  # the others wait at this window's count agreement
                    agreement.tell(Status.FETCH, index)
                raise
            if not batches:
                if agreement is not None:
                    left, _ = agreement.meet(
                        0,
                        where=f"the end of the micro-batches after {index} windows",
                        status=Status.EXHAUSTED,
                        window=index,
                    )
                    self.uneven_stop = agreement.uneven_stop(index, 0, left)
                return
            local_count = sum(counts)
            empty = False  # whether some rank has a micro-batch counting 0 items
            if agreement is None:
                global_count = local_count
            else:
                global_count, empty = agreement.meet(
                    local_count, where=f"the count agreement of window {index}", empty=0 in counts
                )
                self.uneven_stop = agreement.uneven_stop(index, len(batches), global_count)
                if self.uneven_stop is not None:
                    return  # another rank ran out: every rank stops after this many steps
            if global_count == 0:
                raise ConfigError(
                    f"window {index} has a total count of 0 counted items over "
                    f"{self.world_size} rank(s) (this rank's counts per micro-batch: {counts}); "
                    "the mean loss is undefined. Drop micro-batches with nothing to count, or fix "
                    "count_fn"
                )
            previous = Window(self, batches, counts, index, global_count, count_fn)
            # Where a "mean" loss can be refused on one rank, the ranks agree before the window's
            # synchronised backward; elsewhere refusals are program errors, alike on every rank.
            previous._state.sync_due = previous._state.agrees and empty
            yield previous

    def _fetch(
        self,
        iterator: Iterator[B],
        previous: Window[B] | None,
        index: int,
        count_fn: Callable[[B], int | torch.Tensor] | None,
    ) -> tuple[list[B], list[int]]:
        """The next window's micro-batches and their counts (none when the iterable is done)."""
        if previous is not None and previous.pending_backward:
            raise ConfigError(
                f"window {previous.index} ran backward but window.step() was not called; "
                "call window.step() after the micro-steps of every window, or its gradients "
                "would be added to the next window's"
            )
        if previous is not None:
            previous._state.sync_due = False  # the agreement this rank meets next is the count's
        batches = list(itertools.islice(iterator, self.gradient_accumulation_steps))
        if not batches:
            return [], []
        if count_fn is None:
            counts = [leading_dim(b) for b in batches]
        else:
            counts = [as_count(count_fn(b), index, i) for i, b in enumerate(batches)]
        if not self._norm_checked:
            self._check_batch_norm(batches)
        return batches, counts

    def _forward_communicates(self) -> bool:
        """Whether a forward pass runs a collective (DDP's buffer broadcast, FSDP2's
        all-gathers)."""
        return self._parallel is not None and self._parallel.forward_communicates

    def _check_batch_norm(self, batches: Sequence[Any]) -> None:
        self._norm_checked = True
        if not any(isinstance(m, _BatchNorm) and m.training for m in self.model.modules()):
            return
        try:
            sizes = [leading_dim(b) for b in batches]
        except ConfigError:
            return  # no tensor to measure; nothing reliable to say
        largest = max(sizes)
        if largest < SMALL_MICRO_BATCH_FOR_BATCH_NORM:
            warnings.warn(
                f"the model has BatchNorm layers in training mode and micro-batches of "
                f"{largest} samples (< {SMALL_MICRO_BATCH_FOR_BATCH_NORM}): their statistics "
                "come from one micro-batch, not the effective batch. Use a larger micro-batch, "
                "GroupNorm/LayerNorm, or BatchNorm in eval mode",
                SmallMicroBatchNormWarning,
                stacklevel=3,
            )
