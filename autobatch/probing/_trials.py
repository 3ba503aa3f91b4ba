"""The probe's trials: one real step at a micro-batch size, measured, classified and agreed.

:class:`TrialRunner` holds one probe's state (the step, the points and trials so far, the notes)
and runs its trials; :class:`~autobatch.probing._probe_run.Prober` builds the search on it.
A trial's :class:`Outcome` is classified right where the step raised
(:func:`autobatch.device.is_oom`), the ranks agree on the worst through a
:class:`~autobatch.distributed.Consensus`, and after a failure no reference to the failed step
survives (gradients dropped, the allocator cache emptied).
Not public: use :func:`autobatch.probe`.

Example::

    runner._trial(8)             # one step at micro-batch 8, recorded
    runner.trials[-1].fits, runner.points[-1].peak_bytes
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from autobatch.device import (
    BudgetReading,
    Capacity,
    MemoryBudget,
    PeakMemory,
    combine_budget,
    is_oom,
)
from autobatch.distributed import (
    FSDP2_LAYOUT,
    FSDP2_TP_LAYOUT,
    data_parallel,
    process_groups_faked,
    reset_fsdp2,
)
from autobatch.errors import (
    ConfigError,
    DistributedError,
    DoesNotFitError,
    StepFailedError,
)
from autobatch.probing._compiled import mark_batch_dynamic
from autobatch.probing._options import ProbeOptions, StepSpec
from autobatch.probing._parallel import FAKED_NOTE
from autobatch.probing._search import Point, bracket
from autobatch.probing._snapshot import resident_tensors
from autobatch.probing._step import MicroStepWindow, OptimizerSteps, TrainingStep
from autobatch.probing._trial_failures import (
    failure_hint,
    needs_two_samples,
    never_updated,
    num_trainable,
    on_rank,
    static_bytes,
    what_binds,
)
from autobatch.profile import MemoryModel, Trial
from autobatch.units import format_bytes

__all__ = ["MAX_WARM_UP_CALLS", "UNRELIABLE_ESTIMATE", "Outcome", "TrialLog", "TrialRunner"]

MAX_WARM_UP_CALLS = 64
"""Calls the warm-up makes to a ``train_step`` that updates by itself (``step_includes_update``)
until it steps the optimizer (one that accumulates gradients over several calls); a step that
never does within this many calls is refused, as its optimizer state would never appear."""

UNRELIABLE_ESTIMATE = 0.25
"""Relative error of the estimated peak (against the measured one) above which the estimate is
called unreliable for this step, and the search goes on from measurements alone."""


class Outcome(enum.Enum):
    """How one trial ended; the ranks agree on the worst (the lowest value)."""

    FAILED = 0
    """Raised something other than running out of memory: an upper bound on the sizes that run
    (at the first size, the end of the probe)."""
    OOM = 1
    """Ran out of memory."""
    OVER_CAPACITY = 2
    """Finished, with a peak over this device's capacity."""
    FITS = 3
    """Finished within the capacity."""

    @property
    def ran(self) -> bool:
        """The step finished, so its peak was measured."""
        return self in (Outcome.OVER_CAPACITY, Outcome.FITS)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Agreed:
    """One trial's outcome as every rank sees it (see ``TrialRunner._agree_outcome``)."""

    outcome: Outcome
    rank: int
    """Lowest rank with that outcome."""
    peak_bytes: int
    """Largest rank's peak when every rank measured one, else 0."""
    fatal_rank: int | None
    """Lowest rank whose error ends the probe, None when none."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _Ran:
    """One trial's step as this rank ran it, before the ranks agree (``TrialRunner._run_steps``)."""

    outcome: Outcome
    error: str = ""
    """The failure, or the peak over the capacity, in one line ("" when it fitted)."""
    fatal: Exception | None = None
    """This rank's error that ends the probe, raised once every rank knows."""
    calls: int = 0
    """Calls of the step (more than one only while waiting for an optimizer step)."""
    updated: bool = False
    """Whether the optimizer stepped."""
    seconds: float = 0.0
    """Wall time of the calls."""
    clock_seconds: float = 0.0
    """The same on the device's clock."""
    allocated_bytes: int = 0
    """Peak allocated bytes (0 unless the step finished)."""
    reserved_bytes: int = 0
    """Peak reserved bytes (0 unless the step finished)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class TrialLog:
    """What one probe's trials showed, in order: :class:`TrialRunner` writes it, the search reads
    it and builds the profile from it."""

    trials: list[Trial] = dataclasses.field(default_factory=list)
    points: list[Point] = dataclasses.field(default_factory=list)
    """One per size tried (a size run twice keeps one, with both steps' outcome)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """The profile's notes, in the order things happened."""
    num_steps: int = 0
    """Real steps run (warm-ups, repeats and compiled confirmations included)."""
    failed_micro_batch_size: int = 0
    """Smallest size that failed for a reason other than memory (0: none did)."""
    warm_up_peak_bytes: int = 0
    """The warm-up step's peak, the largest over the ranks (0: unknown); kept out of ``points``
    (the optimizer state it created would tilt the search's lines), a floor for the margin."""
    prior: MemoryModel | None = None
    """The estimate's memory line; dropped when a measured peak shows it unreliable."""
    estimated_static_bytes: int = 0
    """The estimate's resident bytes (weights, optimizer state), for DoesNotFitError's text."""
    trial_seconds: list[float] = dataclasses.field(default_factory=list)
    """Each trial's time on the device's clock (one per entry of ``trials``), clean-up aside."""
    cleanup_seconds: list[float] = dataclasses.field(default_factory=list)
    """The clean-up after each trial on the device's clock (0 where the step ran)."""
    estimate_seconds: float = 0.0
    """The estimate in all, on the probe's clock (:attr:`ProbeOptions.clock`; 0: it did not
    run)."""
    fake_step_seconds: list[float] = dataclasses.field(default_factory=list)
    """Each fake step of the estimate, on the probe's clock."""


class TrialRunner:
    """Runs one probe's trials: each one real step at a size, measured, classified, agreed with
    the other ranks, and recorded in ``log``. Not public: use :func:`autobatch.probe`.

    Args:
        step: what the step is.
        options: how to probe.
        optimizer: the optimizer the trials step (the user's, or the probe's own AdamW).
        log: where the trials are recorded.
    """

    own_capacity: Capacity
    """This device's capacity, read when the search starts (:meth:`start`)."""
    agreed_capacity: Capacity
    """The capacity searched: this device's, lowered to the smallest rank's."""

    def __init__(
        self,
        step: StepSpec,
        options: ProbeOptions,
        *,
        optimizer: torch.optim.Optimizer,
        log: TrialLog,
    ) -> None:
        self.spec = step
        self.options = options
        self.optimizer = optimizer
        self.log = log
        self.model = step.model
        self.device = options.device
        self.consensus = options.consensus
        self.limit = options.search_limit
        self.static_bytes_hint: Callable[[], int] | None = None
        """The resident bytes (weights, optimizer state) a fake step shows, for
        DoesNotFitError's text when the warm-up does not fit before any estimate ran (the
        optimizer's real state is dropped with the failed step); None: none."""
        scaler = None
        if step.amp_dtype == torch.float16:
            scaler = torch.amp.GradScaler(self.device.torch_device.type)
        # A DDP or FSDP2 model: micro-steps as a window runs them (options.gradient_sync).
        num_micro_steps = options.gradient_sync.num_micro_steps
        parallel = data_parallel(step.model, probing=True) if num_micro_steps > 1 else None
        self.training_step = TrainingStep(
            step.model,
            optimizer,
            loss_fn=step.loss_fn,
            train_step=step.train_step,
            step_includes_update=step.step_includes_update,
            amp_dtype=step.amp_dtype,
            grad_scaler=scaler,
            step_on_overflow=True,
            window=MicroStepWindow(
                num_micro_steps=num_micro_steps,
                skip_sync=None if parallel is None else parallel.skipped,
                lead_batch=None if parallel is None else step.source.make(1),
            ),
        )
        if parallel is not None:
            log.notes.append(
                f"{parallel.wrapper}: each trial ran {num_micro_steps - 1} micro-step(s) of the "
                "smallest size with the gradient reduction skipped, then one of the trial's size "
                "and the optimizer step, as a loop that reduces once per window runs them, so "
                "the gradients held between micro-steps (FSDP2: unsharded) are in the measured "
                "peaks"
            )

    def start(self) -> Capacity:
        """Read this device's capacity and agree the one searched (the smallest rank's)."""
        self.own_capacity = self.device.capacity()
        self.agreed_capacity = self._agree_capacity(self.own_capacity)
        return self.agreed_capacity

    def needs_state(self) -> bool:
        """Whether the measured steps need the optimizer state: every training step does; an
        evaluation does when it runs during training (an optimizer was given)."""
        return not self.options.eval or self.spec.optimizer is not None

    def _run_step(self, batch: Any, *, train: bool) -> None:
        """A training step (model in train mode) or an evaluation step (model in eval mode).

        Every process group's collectives inside it (the ``train_step``'s own too) go to a fake
        backend (:func:`autobatch.distributed._fake_backend.process_groups_faked`): a rank that runs
        out
        of memory before one leaves no other rank waiting in it. The agreement after the step
        runs on the real groups again."""
        self.model.train(train)
        with process_groups_faked() as groups:
            if train:
                self.training_step.run(batch)
            else:
                self.training_step.evaluate(batch)
        if groups and FAKED_NOTE not in self.log.notes and self.consensus.world_size > 1:
            self.log.notes.append(FAKED_NOTE)

    def _agree_capacity(self, own: Capacity) -> Capacity:
        """This device's capacity, lowered to the smallest rank's (the capacity searched)."""
        (packed,) = self.consensus.min_ints([self._with_rank(own.capacity_bytes)])
        smallest, rank = divmod(packed, self.consensus.world_size)
        if self.consensus.world_size > 1:
            self.log.notes.append(
                f"agreed over {self.consensus.world_size} ranks (a size fits only if it fits on "
                f"every rank): the smallest capacity is {format_bytes(smallest)}, on rank {rank}"
            )
        return dataclasses.replace(
            own, capacity_bytes=smallest, budget=_with_ranks(own, smallest, rank)
        )

    def _with_rank(self, value: int) -> int:
        """``value`` packed with this rank: the minimum over the ranks also names the (lowest)
        rank that holds it, by ``divmod(minimum, world_size)``."""
        return value * self.consensus.world_size + self.consensus.rank

    def agree_size(self, size: int | None) -> int | None:
        """Rank 0's choice of the next size (None: the search is over), on every rank."""
        (agreed,) = self.consensus.broadcast_ints([0 if size is None else size])
        return agreed or None

    def warm_up(self) -> None:
        """One step at micro-batch 1 to create the optimizer state (Adam's moments); at 2 when 1
        cannot train (BatchNorm needs more than one value per channel). A compiled step measured
        as compiled also warms up at 2, where Dynamo compiles the graph for every size above 1,
        so that no measured step's time includes compilation."""
        try:
            self.trial(1, warm_up=True)
        except StepFailedError as exc:
            if not needs_two_samples(exc.__cause__) or self.limit < 2:
                raise
            self.log.notes.append(
                "micro-batch 1 cannot train (BatchNorm needs more than one value per channel); "
                "warmed up at 2: keep every micro-batch at 2 or more"
            )
            window = self.training_step.window
            if window.lead_batch is not None:
                self.training_step.window = dataclasses.replace(
                    window, lead_batch=self.spec.source.make(2)
                )
            self.trial(2, warm_up=True)
            return
        if self.options.compiled == "measured" and self.limit >= 2:
            self.trial(2, warm_up=True)

    def confirm_compiled(self, size: int) -> None:
        """Run the compiled step once at ``size``, outside any dispatch mode (no memory counted).

        Raises:
            StepFailedError: the compiled step failed here (or DistributedError on the other
                ranks).
        """
        self.device.release()
        failure: StepFailedError | None = None
        try:
            self._run_step(self.spec.source.make(size), train=not self.options.eval)
        except Exception as exc:  # any failure: the eager measurements do not describe this step
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            failure = StepFailedError(
                f"the trials ran the step eagerly (memory is counted with a dispatch mode on "
                f"{self.device.name}), but the torch.compile'd step failed at the chosen "
                f"micro-batch {size}: {type(exc).__name__}: {first_line}. Fix the compiled "
                "step, or probe the uncompiled model",
                micro_batch_size=size,
            )
            failure.__cause__ = exc
        self.log.num_steps += 1
        if failure is not None:
            self._clean_up_after_failure()
        ranks = self.consensus.world_size
        (failed_rank,) = self.consensus.min_ints([self.consensus.rank if failure else ranks])
        if failure is not None:
            raise failure
        if failed_rank < ranks:
            raise DistributedError(
                f"rank {failed_rank}'s torch.compile'd step failed at micro-batch {size} (its "
                "own error says why); every rank stopped"
            )
        self.log.notes.append(
            f"torch.compile: trials ran the step eagerly (memory counted with a dispatch mode); "
            f"the compiled step ran at micro-batch {size}, its peak not measured"
        )

    def trial(self, size: int, *, warm_up: bool = False, repeat: bool = False) -> None:
        """Run one real step at ``size``, agree on its outcome with the other ranks, record it.

        A warm-up runs a ``train_step`` that updates by itself again (up to
        :data:`MAX_WARM_UP_CALLS` calls) until it steps the optimizer. A ``repeat`` is the second
        step at a size that fitted: the size's point keeps the larger peak, or no longer fits; it
        too runs until the optimizer steps when the size's trial did not step it, so the chosen
        size's peak includes the update.

        Raises:
            StepFailedError: a non-OOM failure before any size passed.
            ConfigError: the step is misconfigured, or a warm-up never stepped the optimizer.
            DistributedError: another rank raised one of those.
            DoesNotFitError: the warm-up did not fit.
        """
        self.device.release()
        train = warm_up or not self.options.eval
        # The chosen size must have run a measured step with an update: when its trial skipped
        # it, its second step runs the step again (bounded, as the warm-up is) until one does.
        must_update = warm_up or (repeat and train and not self._updated_at(size))
        calls = MAX_WARM_UP_CALLS if must_update and self.spec.step_includes_update else 1
        ran = self._run_steps(size, train=train, calls=calls)
        self.log.num_steps += ran.calls
        skipped_update = train and ran.outcome.ran and not ran.updated
        if skipped_update and must_update:
            ran.outcome = Outcome.FAILED
            ran.allocated_bytes = ran.reserved_bytes = 0
            ran.error = f"no optimizer step in {ran.calls} calls"
            ran.fatal = never_updated(
                self.optimizer, size=size, calls=ran.calls, max_calls=MAX_WARM_UP_CALLS
            )
        cleanup_seconds = 0.0
        if not ran.outcome.ran:
            cleanup_started = self.device.clock()
            self._clean_up_after_failure()
            cleanup_seconds = self.device.clock() - cleanup_started
        agreed = self._agree_on(size, ran)
        trial = Trial(
            micro_batch_size=size,
            fits=agreed.outcome is Outcome.FITS,
            oom=ran.outcome is Outcome.OOM,
            peak_allocated_bytes=ran.allocated_bytes,
            peak_reserved_bytes=ran.reserved_bytes,
            step_seconds=ran.seconds if ran.outcome.ran else 0.0,
            error=ran.error,
            warm_up=warm_up,
            skipped_optimizer_step=skipped_update,
            repeat=repeat,
            estimated_peak_bytes=(
                self.log.prior.peak_bytes(size)
                if self.log.prior is not None and ran.outcome.ran and not warm_up
                else 0
            ),
        )
        self.log.trials.append(trial)
        self.log.trial_seconds.append(max(0.0, ran.clock_seconds))
        self.log.cleanup_seconds.append(max(0.0, cleanup_seconds))
        self._record_point(trial, agreed.peak_bytes)
        if self.options.on_trial is not None:
            self.options.on_trial(trial)
        if warm_up and not trial.fits:
            self.does_not_fit(agreed.rank)
        if agreed.outcome is Outcome.FAILED and not 0 < self.log.failed_micro_batch_size < size:
            self.log.failed_micro_batch_size = size  # the smallest size that failed so
        self._check_estimate(trial)

    def _updated_at(self, size: int) -> bool:
        """Whether a trial at ``size`` (not a warm-up) fitted and stepped the optimizer."""
        return any(
            t.micro_batch_size == size and t.fits and not t.warm_up and not t.skipped_optimizer_step
            for t in self.log.trials
        )

    def _run_steps(self, size: int, *, train: bool, calls: int) -> _Ran:
        """Run the step at ``size`` under the device's measurement, up to ``calls`` times until
        the optimizer steps, and classify how it ended right where it raised (only a fatal
        error is kept, to be raised once every rank knows)."""
        ran = _Ran(outcome=Outcome.FITS)
        updates = OptimizerSteps(self.optimizer)
        peak: PeakMemory | None = None
        clock_started = self.device.clock()
        started = time.perf_counter()
        try:
            with self.device.measure(resident_tensors(self.model, self.optimizer)) as peak, updates:
                while ran.calls == 0 or (ran.calls < calls and not updates.count):
                    ran.calls += 1
                    self._run_step(self._batch(size), train=train)
                self.device.synchronize()
            within = peak.reserved_bytes <= self.own_capacity.capacity_bytes
            ran.outcome = Outcome.FITS if within else Outcome.OVER_CAPACITY
        except Exception as exc:  # classified right here; only a fatal one is kept
            oom = not isinstance(exc, ConfigError) and is_oom(exc)
            ran.outcome = Outcome.OOM if oom else Outcome.FAILED
            ran.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if isinstance(exc, ConfigError):
                ran.fatal = exc
            elif ran.outcome is Outcome.FAILED and bracket(self.log.points)[0] == 0:
                failed = StepFailedError(
                    f"the training step failed at micro-batch {size} for a reason other than "
                    f"memory: {ran.error}{failure_hint(exc, ranks=self.consensus.world_size)}",
                    micro_batch_size=size,
                )
                failed.__cause__ = exc
                ran.fatal = failed
        ran.seconds = time.perf_counter() - started
        ran.clock_seconds = self.device.clock() - clock_started
        ran.updated = updates.count > 0
        if peak is not None and ran.outcome.ran:
            ran.allocated_bytes, ran.reserved_bytes = peak.allocated_bytes, peak.reserved_bytes
        if ran.outcome is Outcome.OVER_CAPACITY:
            ran.error = (
                f"peak {format_bytes(ran.reserved_bytes)} is over the capacity "
                f"{format_bytes(self.own_capacity.capacity_bytes)}"
            )
        return ran

    def _agree_on(self, size: int, ran: _Ran) -> _Agreed:
        """The ranks' agreed outcome of this trial; raises this rank's fatal error, or names the
        rank whose error ends the probe; ``ran.error`` says when another rank did worse.

        Raises:
            DistributedError: another rank's error ends the probe.
        """
        agreed = self._agree_outcome(ran.outcome, ran.reserved_bytes, ran.fatal is not None)
        if ran.fatal is not None:
            raise ran.fatal
        if agreed.fatal_rank is not None:
            raise DistributedError(
                f"rank {agreed.fatal_rank} failed at micro-batch {size} for a reason other than "
                "memory (its own error says why); every rank stopped probing"
            )
        if agreed.outcome is not ran.outcome:  # another rank did worse
            ran.error = (
                f"rank {agreed.rank} failed for a reason other than memory"
                if agreed.outcome is Outcome.FAILED
                else f"micro-batch {size} does not fit on rank {agreed.rank}"
            )
        return agreed

    def _record_point(self, trial: Trial, peak_bytes: int) -> None:
        """The search's point for ``trial``, with the ranks' agreed peak: a warm-up's peak is
        kept apart, and a repeat's point is both steps' outcome at its size."""
        size = trial.micro_batch_size
        if trial.warm_up:
            self.log.warm_up_peak_bytes, peak_bytes = peak_bytes, 0
        if trial.repeat:
            first_peaks = [p.peak_bytes for p in self.log.points if p.micro_batch_size == size]
            self.log.points = [p for p in self.log.points if p.micro_batch_size != size]
            if trial.fits:
                peak_bytes = max(peak_bytes, *first_peaks)
        self.log.points.append(
            Point(
                micro_batch_size=size, fits=trial.fits, peak_bytes=peak_bytes, warm_up=trial.warm_up
            )
        )

    def _agree_outcome(self, outcome: Outcome, peak_bytes: int, fatal: bool) -> _Agreed:
        """Every rank's outcome of one trial, as one (a single collective): the worst outcome and
        the lowest rank that had it, the largest peak when every rank measured one, and the
        lowest rank that raises."""
        ranks = self.consensus.world_size
        worst, min_peak, minus_max_peak, fatal_rank = self.consensus.min_ints(
            [
                self._with_rank(outcome.value),
                peak_bytes,
                -peak_bytes,
                self.consensus.rank if fatal else ranks,
            ]
        )
        value, rank = divmod(worst, ranks)
        return _Agreed(
            outcome=Outcome(value),
            rank=rank,
            peak_bytes=-minus_max_peak if min_peak > 0 else 0,
            fatal_rank=fatal_rank if fatal_rank < ranks else None,
        )

    def _check_estimate(self, trial: Trial) -> None:
        """Drop the prior when a measured peak shows it off by more than UNRELIABLE_ESTIMATE."""
        error = trial.estimate_error
        if error is None or abs(error) <= UNRELIABLE_ESTIMATE or self.log.prior is None:
            return
        self.log.prior = None
        self.log.notes.append(
            f"the estimate was unreliable for this step: at micro-batch {trial.micro_batch_size} "
            f"it predicted {format_bytes(trial.estimated_peak_bytes)}, the step measured "
            f"{format_bytes(trial.peak_allocated_bytes)} ({error:+.0%}); the search went on from "
            "measurements alone"
        )

    def _batch(self, size: int) -> Any:
        """The micro-batch of ``size``; its batch dimension dynamic for a step measured compiled,
        so that the sizes tried share one compiled graph."""
        batch = self.spec.source.make(size)
        if self.options.compiled == "measured":
            mark_batch_dynamic(batch)
        return batch

    def _clean_up_after_failure(self) -> None:
        """Drop what the failed step left (gradients, a half-built optimizer state), collect
        garbage, then empty the allocator cache. An FSDP2 model (2-D with tensor parallel too)
        gets its parameters resharded and its per-step state reset (the step stopped
        mid-forward or mid-backward); tensor parallelism keeps no per-step state."""
        if self.options.layout in (FSDP2_LAYOUT, FSDP2_TP_LAYOUT):
            reset_fsdp2(self.model)
        for param in self.model.parameters():
            param.grad = None
        if self.optimizer.state and len(self.optimizer.state) != num_trainable(self.optimizer):
            self.optimizer.state.clear()
        self.device.release()

    def does_not_fit(self, rank: int | None = None) -> NoReturn:
        """Raise DoesNotFitError; ``rank``: the lowest rank where the warm-up did worst."""
        capacity = self.agreed_capacity
        grads = sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad
        )
        estimated = self.log.estimated_static_bytes
        if not estimated and self.static_bytes_hint is not None:
            estimated = self.static_bytes_hint()
        static = max(estimated + grads, static_bytes(self.model, self.optimizer))
        ranks = self.consensus.world_size
        why, remedies = what_binds(static, capacity.capacity_bytes, self.options.conditions)
        raise DoesNotFitError(
            f"the {'evaluation' if self.options.eval else 'training'} step does not fit "
            f"{on_rank(rank, ranks, self.consensus.rank, self.device.name)} even at micro-batch "
            "1: "
            f"capacity {format_bytes(capacity.capacity_bytes)} "
            f"(total {format_bytes(capacity.total_memory_bytes)}, "
            f"{format_bytes(capacity.foreign_memory_bytes)} used by others); the model's static "
            f"footprint (weights, gradients, optimizer state) is about {format_bytes(static)}"
            f"{why}",
            remedies=remedies,
            device_name=self.device.name,
            capacity_bytes=capacity.capacity_bytes,
            required_bytes=static,
            static_bytes=static,
        )


def _with_ranks(own: Capacity, smallest: int, rank: int) -> MemoryBudget | None:
    """This rank's budget, plus the smallest rank's capacity when another rank's is smaller
    (the ``ranks`` source: the capacity the ranks search together)."""
    if own.budget is None or smallest >= own.capacity_bytes:
        return own.budget
    agreed = BudgetReading(
        source="ranks",
        total_bytes=smallest,
        available_bytes=smallest,
        detail=f"the smallest rank's capacity, on rank {rank}: a size fits only if it fits on "
        "every rank",
    )
    return combine_budget([*own.budget.readings, agreed], unseen_sources=own.budget.unseen_sources)
