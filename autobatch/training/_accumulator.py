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
  (:mod:`autobatch.training._window_agreement`), so every rank raises instead of waiting in a
  collective, and a rank that stops answering fails the others within a deadline
  (:mod:`autobatch.distributed._deadline`), naming it;
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
(``Accumulator(..., on_oom="split")``, see :mod:`autobatch.training._oom_split`)::

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
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from autobatch.distributed import AgreementDeadline, Default, resolve_deadline
from autobatch.errors import ConfigError, DistributedError, SmallMicroBatchNormWarning
from autobatch.planning import Plan
from autobatch.probing import check_plan_here, live_world_size
from autobatch.training._counting import as_count, leading_dim
from autobatch.training._loop_checks import check_plan, loop_parallelism
from autobatch.training._oom_split import (
    DEFAULT_OOM_RETRY_WINDOWS,
    OnOom,
    SplitEvent,
    Splitter,
)
from autobatch.training._window import Window
from autobatch.training._window_agreement import Status, UnevenStop, WindowAgreement

__all__ = ["SMALL_MICRO_BATCH_FOR_BATCH_NORM", "Accumulator"]

B = TypeVar("B")

SMALL_MICRO_BATCH_FOR_BATCH_NORM = 16
"""Below this many samples per micro-batch, BatchNorm statistics are noticeably unlike the
effective batch's, so :class:`SmallMicroBatchNormWarning` is emitted."""


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
            :mod:`autobatch.training._oom_split`). The manual ``for micro in window`` loop never
            splits.
        oom_retry_windows: with ``"split"``: windows run at the smaller size, without another
            out-of-memory error, before the planned size is tried again, >= 1.
        on_split: called with each :class:`~autobatch.training._oom_split.SplitEvent`, e.g.
            ``autobatch.tuning.split_recorder(...)`` so the profile store learns the size.
        plan: the plan this loop runs (``autotune``'s): its ``gradient_accumulation_steps``,
            checked against the loop: its world size must be the model's data-parallel ranks,
            and, where the loop skips the gradient reduction between micro-steps (DDP or FSDP2,
            more than one step), it must have been measured in that mode
            (``plan.gradient_sync``).
        agreement_deadline: under DDP or FSDP2, how long each agreement of the ranks but a
            loop's first waits for a peer
            (:class:`~autobatch.distributed._deadline.AgreementDeadline`; by default the longer
            of 120 s, or ``$AUTOBATCH_AGREEMENT_SECONDS``, and 10 times this rank's own work
            since its previous agreement); None: the process group's own timeout.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` not an int >= 1 (or neither it nor
            ``plan`` given), ``max_grad_norm`` not a finite number > 0, ``on_oom`` or
            ``oom_retry_windows`` invalid, a ``ReduceLROnPlateau`` scheduler (it needs a
            metric: step it yourself after ``window.step()``); the model or optimizer is an
            engine that owns accumulation, the model is sharded with FSDP1, or with FSDP2 and
            ``on_oom="split"``; a ``plan`` made for another loop (another world size or
            gradient-sync mode: :func:`autobatch.training._loop_checks.check_plan`,
            :func:`autobatch.probing._live_conditions.check_plan_here`).

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
                sourced_world_size=self._sourced_world_size(),
            )
        self.uneven_stop: UnevenStop | None = None
        """Under DDP or FSDP2, where the latest ``windows()`` loop stopped because some rank's
        micro-batches ran out before the others' (uneven shards), and what it left untrained;
        None when every rank's ran out together."""
        # Checked once, on the first window: done already when there is no BatchNorm at all.
        self._norm_checked = not any(isinstance(m, _BatchNorm) for m in model.modules())

    def _sourced_world_size(self) -> tuple[int, str] | None:
        """This loop's data-parallel ranks and where that comes from; None when it cannot tell
        (torch.distributed without DDP or FSDP2: tensor-parallel ranks are not all
        data-parallel)."""
        if self._parallel is not None:
            return self.world_size, f"{self._parallel.wrapper}'s process group"
        if dist.is_available() and dist.is_initialized():
            return None
        return live_world_size()

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
