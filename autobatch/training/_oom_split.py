"""Run a window's micro-batches, splitting one that runs out of memory, gradient unchanged.

A probe measures the batches it is shown; real data has rare long sequences and dense images,
and the out-of-memory error then comes hours into training. With
``Accumulator(..., on_oom="split")``, :meth:`Window.run <autobatch.training._window.Window.run>`
catches it and runs that micro-batch again in pieces, each weighted by its own count of the
window's total, so the window's gradient is the one the unsplit micro-batch would have given (up to
floating-point summation order; dropout draws other masks; BatchNorm in training mode: below).

The rules:

- **Pieces come from the original micro-batch.** A micro-batch of ``n`` rows that fails at piece
  size ``s`` is run as rows ``[0:s')``, ``[s':2s')``... of the original, with ``s' = ceil(s / 2)``
  (never a piece of a piece: sizes go 8, 4, 2, 1). Every tensor whose dim 0 is ``n`` is sliced;
  other leaves pass unchanged.
- **Forward or backward.** An error in ``loss_of`` (the forward) leaves the gradients as they
  were, so the rows already done stay done. An error in backward may have added part of a
  gradient, so the window's gradients are zeroed and its micro-batches so far are run again at the
  smaller size.
- **Memory first.** The failed pass's references (the exception and its traceback hold frames
  full of tensors) are dropped, then ``gc.collect()`` and, on CUDA, ``torch.cuda.empty_cache()``
  run outside the ``except`` block.
- **Later micro-batches** run in pieces of at most the smaller size (``StepStats.
  micro_batch_size_limit``). After ``oom_retry_windows`` windows (default
  :data:`DEFAULT_OOM_RETRY_WINDOWS`) in a row without an out-of-memory error, the limit is lifted
  and the planned size is tried again; a window that splits starts the count anew.
- **BatchNorm** (any ``_BatchNorm`` in training mode, or without running statistics)
  normalises each piece by the piece's own statistics, so for such a model the split gradient is
  the pieces' (each weighted by its count), not the unsplit one's; and a piece of 1 sample would
  give it 1 value per channel, which torch refuses. Pieces of such a model are never cut below 2
  rows: a last piece of 1 row takes a row from the one before (7 rows by 3: 3, 2, 2) or joins it
  (5 by 2: 2, 3, one row over the limit).
- **Rows that cannot be cut smaller** raise :class:`~autobatch.errors.DoesNotFitError` naming the
  window, the micro-batch and the rows: a row that does not fit alone, or, with BatchNorm, a piece
  of 2 rows (or a last piece of 3) that does not fit; that error names the layer and carries the
  remedies. The window's gradients are dropped (as on any error in :func:`run_window`) and
  nothing is stepped, so a loop that catches it skips the window.
- **Every split is reported**: a WARNING on the ``autobatch`` logger (window, micro-batch, old and
  new sizes, reason) and a :class:`SplitEvent` in ``StepStats.splits``. To have ``autotune``'s
  store learn the smaller size, pass ``on_split=autobatch.tuning.split_recorder(...)``.
- **DistributedDataParallel**: once per micro-step the ranks agree on the smallest piece-size
  limit, so they split together, and an error on one rank reaches the others there instead of
  leaving them waiting; a forward pass must not communicate (``broadcast_buffers=False``, no
  ``SyncBatchNorm`` in training mode). The rules are :mod:`autobatch.training._limit_agreement`'s.

Example::

    acc = Accumulator(model, optimizer, gradient_accumulation_steps=4, on_oom="split")
    for window in acc.windows(loader):
        stats = window.run(lambda batch: model(**batch).loss)
        for split in stats.splits:
            print(split.old_micro_batch_size, "->", split.new_micro_batch_size)
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from typing import Any, Literal, NoReturn

import torch

from autobatch.device import is_oom
from autobatch.errors import ConfigError, DistributedError, DoesNotFitError, Remedy
from autobatch.training._counting import as_count
from autobatch.training._limit_agreement import LimitAgreement, refuse_collective_forward
from autobatch.training._micro_step import MicroStep, WindowState, check_backward
from autobatch.training._pieces import batch_norm_layer, piece_bounds, rows_to_cut, slice_rows

__all__ = ["DEFAULT_OOM_RETRY_WINDOWS", "OnOom", "SplitEvent", "Splitter", "run_window"]

OnOom = Literal["raise", "split"]

DEFAULT_OOM_RETRY_WINDOWS = 16
"""Windows in a row without an out-of-memory error after which the planned size is tried again."""

logger = logging.getLogger("autobatch")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SplitEvent:
    """One micro-batch run in smaller pieces after an out-of-memory error."""

    window_index: int
    """The window (0-based, within one ``windows()`` loop)."""
    micro_step_index: int
    """The micro-batch within the window (0-based)."""
    old_micro_batch_size: int
    """Rows of the piece that ran out of memory (the whole micro-batch the first time)."""
    new_micro_batch_size: int
    """Rows per piece from now on, >= 1."""
    phase: Literal["forward", "backward", "peer"]
    """Where it ran out: the user's ``loss_of``, the backward, or on another rank (``"peer"``:
    this rank adopts the smaller size the ranks agreed on)."""
    reason: str
    """The error's first line (e.g. ``CUDA out of memory. Tried to allocate 2.00 GiB...``)."""
    recomputed: bool = False
    """True when the window's micro-batches so far were run again (an error in backward)."""


class Splitter:
    """An Accumulator's split policy and the piece-size limit it carries between windows.

    Args:
        on_oom: ``"raise"`` or ``"split"``.
        retry_windows: see ``Accumulator(oom_retry_windows=...)``, >= 1.
        on_split: called with every :class:`SplitEvent`, after it is logged.

    Raises:
        ConfigError: ``on_oom`` is not one of the two, or ``retry_windows`` is not an int >= 1.
    """

    __slots__ = ("_clean_windows", "limit", "on_oom", "on_split", "retry_windows")

    def __init__(
        self,
        *,
        on_oom: OnOom,
        retry_windows: int,
        on_split: Callable[[SplitEvent], None] | None = None,
    ) -> None:
        if on_oom not in ("raise", "split"):
            raise ConfigError(f"on_oom must be 'raise' or 'split', got {on_oom!r}")
        if (
            isinstance(retry_windows, bool)
            or not isinstance(retry_windows, int)
            or retry_windows < 1
        ):
            raise ConfigError(
                f"oom_retry_windows must be an int >= 1, got {retry_windows!r}; it is how many "
                f"windows run at the smaller size before the planned one is tried again "
                f"(default {DEFAULT_OOM_RETRY_WINDOWS})"
            )
        self.on_oom: OnOom = on_oom
        self.retry_windows = retry_windows
        self.on_split = on_split
        self.limit: int | None = None
        """Largest piece (rows) run now; None: micro-batches run whole."""
        self._clean_windows = 0

    def start_window(self, window_index: int) -> None:
        if self.limit is not None and self._clean_windows >= self.retry_windows:
            logger.info(
                "window %d: %d windows ran without running out of memory at micro-batch size "
                "%d or less; trying the planned size again",
                window_index,
                self._clean_windows,
                self.limit,
            )
            self.limit = None

    def end_window(self, had_split: bool) -> None:
        self._clean_windows = 0 if had_split else self._clean_windows + 1


@dataclasses.dataclass(slots=True)
class _Failure:
    """What is kept of an out-of-memory error once its ``except`` block is left."""

    phase: Literal["forward", "backward"]
    reason: str
    start: int
    """First row of the piece that failed."""
    rows: int
    """Rows of the piece that failed."""


class _WindowRun:
    """One call of :func:`run_window`: the cursor over (micro-batch, row) and the bookkeeping."""

    def __init__(
        self,
        state: WindowState,
        loss_of: Callable[[Any], torch.Tensor],
        reduction: Literal["mean", "sum"],
        *,
        model: torch.nn.Module,
        splitter: Splitter,
    ) -> None:
        self.state = state
        self.model = model
        self.splitter = splitter
        self.loss_of = loss_of
        self.reduction = reduction
        self.micros = list(state.micro_steps)
        self.ddp = state.ddp
        self.events: list[SplitEvent] = []
        # Under DDP with splitting: the ranks' once-per-micro-step limit agreement.
        self.ranks: LimitAgreement | None = None
        if state.agreement is not None and splitter.on_oom == "split":
            self.ranks = LimitAgreement(
                state.agreement.agreements,
                self._device(),
                window_index=state.index,
                num_micro_steps=len(self.micros),
            )
        self.deferred: SplitEvent | None = None  # a peer's split agreed at the last micro-step
        self.had_split = False
        self.done_count = 0  # counted items of the current micro-batch's pieces done
        self.norm: tuple[str, torch.nn.Module] | None | bool = False  # False: not looked for yet

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        micros = self.micros
        index, start = 0, 0
        while index < len(micros):
            failure = self._run_rows(micros[index], start)
            if failure is None:
                ranks = self.ranks
                if ranks is not None and index == ranks.num_agreed and index < len(micros) - 1:
                    self._agree(ranks, index)
                index, start = index + 1, 0
                continue
            # Outside the except block: the failed pass's frames are gone, so its memory can go.
            _release(self._device())
            new_size = (failure.rows + 1) // 2
            if not self._can_cut(micros[index], failure, new_size):
                self._does_not_fit(micros[index], failure)
            recompute = failure.phase == "backward" and (index > 0 or failure.start > 0)
            self._record(index, failure, new_size, recompute)
            if failure.phase == "backward":
                # A backward that failed may have added part of its gradient: start the window
                # again from no gradient (the micro-batches done so far are run again).
                self.state.forget_backward()
                index, start = 0, 0
            else:
                start = failure.start  # the forward added nothing; earlier rows stay done

    def _run_rows(self, micro: MicroStep[Any], start: int) -> _Failure | None:
        """Run rows ``[start:)`` of one micro-batch in pieces of the limit; the first OOM."""
        limit = self.splitter.limit
        is_last = micro.is_last
        if start == 0 and limit is None:
            return self._run_piece(micro, micro.batch, 0, -1, synced=is_last)
        rows = rows_to_cut(micro.batch, self.state.index, micro.index)
        if start == 0 and rows <= (limit or rows):
            return self._run_piece(micro, micro.batch, 0, rows, synced=is_last)
        size = limit if limit is not None else rows
        count_fn = self.state.count_fn
        if start == 0:
            self.done_count = 0
        pieces = []
        for piece_start, stop in piece_bounds(start, rows, size, self._min_rows()):
            piece = slice_rows(micro.batch, piece_start, stop, rows)
            if count_fn is None:
                count = stop - piece_start
            else:
                count = as_count(count_fn(piece), self.state.index, micro.index)
            pieces.append((piece_start, stop, piece, count))
        if self.done_count + sum(piece[3] for piece in pieces) != micro.count:
            raise ConfigError(
                f"count_fn is not additive over rows: micro-batch {micro.index} of window "
                f"{self.state.index} counts {micro.count}, its pieces "
                f"{self.done_count + sum(piece[3] for piece in pieces)}; the pieces of a split "
                "micro-batch must count what it counts (e.g. count tokens or samples, not a "
                "per-batch constant)"
            )
        synced_at = -1  # the piece that synchronises: the last micro-batch's last counted one
        if is_last:
            counted = [i for i, piece in enumerate(pieces) if piece[3]]
            if counted:
                synced_at = counted[-1]
            elif self.ddp is not None:
                synced_at = len(pieces) - 1  # DDP's all-reduce must still run
        for i, (piece_start, stop, piece, count) in enumerate(pieces):
            synced = i == synced_at
            if count == 0 and not synced:
                continue  # nothing counted: no share of the gradient
            step = MicroStep(self.state, piece, count, micro.index, synced)
            failure = self._run_piece(step, piece, piece_start, stop - piece_start, synced=synced)
            if failure is not None:
                return failure
            self.done_count += count
        return None

    def _run_piece(
        self, step: MicroStep[Any], batch: Any, start: int, rows: int, *, synced: bool
    ) -> _Failure | None:
        """Forward and backward of one piece (``rows`` -1: the whole micro-batch, not yet
        counted); the OOM as a :class:`_Failure`, or None."""
        split = self.splitter.on_oom == "split"
        phase: Literal["forward", "backward"] = "forward"
        reason = ""
        context = step.sync_context()
        try:
            with context:
                loss = self._loss(step, batch)
                if synced and self.ranks is not None:
                    # Backward's own checks (a mean over 0 counted items, a loss of many
                    # elements) before the agreement: past it, an error on one rank leaves the
                    # others waiting in the gradient all-reduce.
                    check_backward(step, loss, self.reduction)
                    self._agree(self.ranks, step.index)
                    phase = "backward"
                    try:
                        step.backward(loss, reduction=self.reduction)
                    except Exception as exc:
                        self._synchronised_backward_failed(self.ranks, step, exc)
                    if self.deferred is not None:  # the all-reduce is done: a callback may raise
                        event, self.deferred = self.deferred, None
                        self._add_event(event)
                else:
                    phase = "backward"
                    step.backward(loss, reduction=self.reduction)
            return None
        except Exception as exc:
            if not split or not is_oom(exc):
                raise
            reason = _first_line(exc)
        # Out of the except block, the exception and its frames are gone; the caller releases
        # memory once this frame (and `loss`, the failed graph) is gone too.
        if rows < 0:
            rows = rows_to_cut(batch, self.state.index, step.index)
        return _Failure(phase=phase, reason=reason, start=start, rows=rows)

    def _loss(self, step: MicroStep[Any], batch: Any) -> torch.Tensor:
        """``loss_of(batch)``; under DDP, refused when it communicates (also when it ran out of
        memory after its collective)."""
        ranks = self.ranks
        if ranks is None:
            return self.loss_of(batch)
        before = ranks.collectives(self.model)
        try:
            return self.loss_of(batch)
        finally:
            ranks.refuse_collectives(
                self.model, before, f"micro-batch {step.index} of window {self.state.index}"
            )

    def _min_rows(self) -> int:
        """Fewest rows a piece may have: 2 when the model normalises with batch statistics."""
        if self.norm is False:
            self.norm = batch_norm_layer(self.model, wrapped=self.ddp is not None)
        return 1 if self.norm is None else 2

    def _can_cut(self, micro: MicroStep[Any], failure: _Failure, new_size: int) -> bool:
        """Whether the rows that ran out of memory can run again in pieces smaller than the one
        that failed (none below :meth:`_min_rows`)."""
        if new_size < self._min_rows():
            return False
        # The rows run again: the failed piece's on (forward), or the micro-batch's (backward).
        first = failure.start if failure.phase == "forward" else 0
        rows = rows_to_cut(micro.batch, self.state.index, micro.index)
        pieces = piece_bounds(first, rows, new_size, self._min_rows())
        return max(stop - start for start, stop in pieces) < failure.rows

    # -- reporting -----------------------------------------------------------------------------

    def _record(self, index: int, failure: _Failure, new_size: int, recompute: bool) -> None:
        self._add_event(
            SplitEvent(
                window_index=self.state.index,
                micro_step_index=index,
                old_micro_batch_size=failure.rows,
                new_micro_batch_size=new_size,
                phase=failure.phase,
                reason=failure.reason,
                recomputed=recompute,
            )
        )

    def _add_event(self, event: SplitEvent) -> None:
        self.splitter.limit = event.new_micro_batch_size
        self.had_split = True
        self.events.append(event)
        where = "on another rank" if event.phase == "peer" else f"in {event.phase}"
        logger.warning(
            "window %d, micro-batch %d: out of memory %s at micro-batch size %d (%s); running "
            "pieces of %d%s. Later micro-batches use at most %d rows until %d windows in a row "
            "run without running out of memory",
            event.window_index,
            event.micro_step_index,
            where,
            event.old_micro_batch_size,
            event.reason,
            event.new_micro_batch_size,
            ", after running the window's earlier micro-batches again" if event.recomputed else "",
            event.new_micro_batch_size,
            self.splitter.retry_windows,
        )
        if self.splitter.on_split is not None:
            self.splitter.on_split(event)

    # -- failures ------------------------------------------------------------------------------

    def _does_not_fit(self, micro: MicroStep[Any], failure: _Failure) -> NoReturn:
        device = self._device()
        where = f"micro-batch {micro.index} of window {self.state.index}"
        dropped = "The window's gradients were dropped: catch the error to skip the window"
        remedies: tuple[Remedy, ...] = ()
        if failure.rows == 1:
            message = (
                f"{where} does not fit even at micro-batch size 1: its row {failure.start} ran "
                f"out of memory in {failure.phase} ({failure.reason}). That sample is larger "
                "than the ones the plan was probed with: probe with the worst case "
                f"(autobatch.worst_case_sample), or truncate it. {dropped}"
            )
        else:
            assert isinstance(self.norm, tuple)  # only a batch norm stops a cut above 1 row
            name, layer = self.norm
            last = failure.start + failure.rows - 1
            message = (
                f"{where} does not fit at micro-batch size {failure.rows}: its rows "
                f"{failure.start}..{last} ran out of memory in {failure.phase} "
                f"({failure.reason}), and on_oom='split' cannot cut them into smaller pieces: "
                f"the model's {type(layer).__name__} layer {name!r} normalises each piece by "
                "its own statistics (training mode, or no running statistics), which needs at "
                "least 2 samples per piece (torch refuses 1: 'Expected more than 1 value per "
                f"channel when training'). {dropped}"
            )
            remedies = (
                Remedy(purpose="the worst-case batch when probing (autobatch.worst_case_sample)"),
                Remedy(purpose="GroupNorm or LayerNorm instead of BatchNorm"),
                Remedy(purpose="BatchNorm in eval mode (normalising with running statistics)"),
            )
        raise DoesNotFitError(
            message,
            device_name=str(device),
            capacity_bytes=_total_memory_bytes(device),
            required_bytes=0,
            static_bytes=_static_bytes(self.state.optimizer),
            remedies=remedies,
        )

    def _synchronised_backward_failed(
        self, ranks: LimitAgreement, step: MicroStep[Any], exc: Exception
    ) -> NoReturn:
        """Any error in the synchronised backward: the other ranks may be in its all-reduce
        (past the agreement, nothing can be agreed), so the group is aborted and they fail."""
        where = f"micro-batch {step.index} of window {self.state.index}"
        rank = ranks.rank
        ranks.abort()
        if is_oom(exc):
            raise DistributedError(
                f"rank {rank} ran out of memory inside the synchronised backward of {where} "
                f"({_first_line(exc)}), where the ranks cannot agree to split (the others are "
                "in the gradient all-reduce). The process group was aborted so that no rank "
                "waits. Probe with the worst-case batch (autobatch.worst_case_sample) or use a "
                "smaller micro-batch"
            ) from exc
        raise DistributedError(
            f"the synchronised backward of {where} failed on rank {rank} "
            f"({type(exc).__name__}: {_first_line(exc)}); if another rank ran out of memory in "
            "it, see that rank's error. The process group was aborted so that no rank waits"
        ) from exc

    # -- ranks ---------------------------------------------------------------------------------

    def _agree(self, ranks: LimitAgreement, index: int) -> None:
        """Micro-step ``index``'s limit agreement; a smaller limit of another rank is adopted
        (after the synchronised backward on the last micro-step, whose all-reduce comes next).

        Raises:
            DistributedError: another rank failed.
        """
        limit = self.splitter.limit
        agreed = ranks.meet(index, limit)
        if agreed is None or (limit is not None and agreed >= limit):
            return
        event = SplitEvent(
            window_index=self.state.index,
            micro_step_index=index,
            old_micro_batch_size=limit
            or rows_to_cut(self.micros[index].batch, self.state.index, index),
            new_micro_batch_size=agreed,
            phase="peer",
            reason="another rank ran out of memory",
        )
        if index == len(self.micros) - 1:
            self.deferred = event
        else:
            self._add_event(event)

    def _device(self) -> torch.device:
        for group in self.state.optimizer.param_groups:
            params: list[torch.Tensor] = group["params"]
            if params:
                return params[0].device
        return torch.device("cpu")


def run_window(
    state: WindowState,
    loss_of: Callable[[Any], torch.Tensor],
    *,
    reduction: Literal["mean", "sum"] = "mean",
    model: torch.nn.Module,
    splitter: Splitter,
) -> list[SplitEvent]:
    """Run a window's forward and backward passes, splitting on OOM as the module says; the
    caller (:meth:`Window.run <autobatch.training._window.Window.run>`) then steps it.

    Args:
        state: the window's state (its micro-steps, counts and backward passes), none of whose
            micro-steps ran backward yet.
        loss_of: ``batch -> loss`` for one micro-batch (or piece): a 0-dim tensor, the mean (or,
            with ``reduction="sum"``, the sum) over its counted items. It must not call backward.
        reduction: how ``loss_of`` reduces over counted items.
        model: the Accumulator's model (a ``DistributedDataParallel`` under DDP).
        splitter: the Accumulator's split policy and the piece-size limit it carries.

    Returns:
        The micro-batches split, in order (``StepStats.splits``).

    Raises:
        ConfigError: the window already ran backward or stepped; under DDP, a forward pass that
            communicates (``broadcast_buffers=True`` with buffers, ``SyncBatchNorm`` in
            training mode), which pieces on one rank would leave unmatched; with
            ``on_oom="split"``, a batch has no tensor with a batch dimension (needed to cut it;
            checked before any step); ``count_fn`` is not additive over rows (the pieces'
            counts do not sum to the micro-batch's; checked before they run); a "mean" loss of a
            micro-batch with 0 counted items; see also ``MicroStep.backward``.
        DoesNotFitError: a micro-batch runs out of memory even at size 1, or, for a model with
            BatchNorm in training mode, at the smallest pieces it allows (2 rows; names the
            batch, the rows and the layer).
            On this and any other error the window's gradients are dropped (set to None) and
            nothing is stepped, so a loop that catches it skips the window.
        DistributedError: under DDP with ``on_oom="split"``, another rank raised an error before
            the ranks agreed to run a micro-step, or this rank's synchronised backward failed
            (the process group is then aborted).
    """
    if state.num_backward or state.stepped:
        raise ConfigError(
            f"window {state.index} already ran backward or stepped; call window.run() instead "
            "of the micro-step loop, not after it"
        )
    run = _WindowRun(state, loss_of, reduction, model=model, splitter=splitter)
    if run.ranks is not None:  # the same on every rank: they all raise, before any collective
        refuse_collective_forward(model)
    try:
        if splitter.on_oom == "split":
            for micro in run.micros:  # before any step, not at the first OOM hours into training
                rows_to_cut(micro.batch, state.index, micro.index)
        splitter.start_window(state.index)
        run.run()
    except BaseException as exc:
        # The window is abandoned: its partial gradient must reach neither a step (it would be
        # weighted as the whole window's) nor the next window, so catching the error skips it.
        state.forget_backward()
        if isinstance(exc, Exception) and run.ranks is not None:
            run.ranks.tell(exc, splitter.limit)  # the other ranks raise too, none waits
            # After the ranks' last agreement of the window (an on_split callback after the
            # synchronised backward): the caller tells them at the next window's.
            state.failed_after_agreements = not run.ranks.peers_know
        raise
    splitter.end_window(run.had_split)
    state.mark_backward_done()
    return run.events


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return 0


def _static_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer's state tensors."""
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            total += param.numel() * param.element_size() * (1 if param.grad is None else 2)
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total
