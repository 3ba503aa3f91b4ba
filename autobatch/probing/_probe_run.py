"""One probe's search over real trials (:class:`Prober`): the warm-up, the estimate when it pays,
then confirm and bisect from what the trials showed, and the profile at the end. The steps of
the probe are described in :mod:`autobatch.probing._prober`, whose :func:`~autobatch.probing.probe`
is the way in.

Example::

    profile = Prober(step, options, optimizer=optimizer).run()
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from autobatch.device import Capacity, SimulatedDevice, node_name
from autobatch.distributed import process_groups_faked
from autobatch.errors import ConfigError, EstimateUnavailableError, PeerObjectError
from autobatch.probing._compiled import eager
from autobatch.probing._estimator import FakeStep, estimate_points
from autobatch.probing._identity import now_iso
from autobatch.probing._live_conditions import with_optimizer_state
from autobatch.probing._options import ProbeOptions, ProbeStage, Stage, StepSpec
from autobatch.probing._search import (
    bracket,
    estimate_budget_seconds,
    fit_wide_line,
    next_micro_batch_size,
    recommended_size,
    trial_budget,
    warm_up_line,
)
from autobatch.probing._trial_failures import resident_bytes
from autobatch.probing._trials import TrialLog, TrialRunner
from autobatch.profile import (
    CONFIRMATION_STOP_REASON,
    MemoryModel,
    ProbeTimings,
    Profile,
    StopKind,
    Trial,
)
from autobatch.units import format_bytes

__all__ = [
    "ESTIMATE_OVERRUN",
    "EXPECTED_FAKE_STEPS",
    "FAKE_STEP_SECONDS_PER_TENSOR",
    "TIMED_STEPS",
    "Prober",
    "default_optimizer",
]


FAKE_STEP_SECONDS_PER_TENSOR = 0.006
"""Predicted seconds of one fake step per parameter tensor of the model, before any fake step has
run. A fake step dispatches every op on the host whatever the device, so its cost grows with the
number of tensors the step touches rather than with the model's FLOPs; ``bench/probe_vs_peers.py``
prints the per-tensor cost it sees. A prediction only: the estimate's own steps replace it once
the first has run."""

ESTIMATE_OVERRUN = 2.0
"""A started estimate stops before a fake step that would take it past this many times its
budget (:func:`~autobatch.probing._search.estimate_budget_seconds`). Its start was judged on a
predicted length (:data:`FAKE_STEP_SECONDS_PER_TENSOR`), which can be off by about 2x either way,
and an estimate stopped short of the memory's edge is worth little: the search then pays real
trials for what a few more fake steps would have found. 2x lets an estimate that was judged
worth starting finish, while bounding what a wrong prediction can cost."""

TIMED_STEPS = 3
"""Timed steps :meth:`Prober.time_at` runs at a plan's micro-batch after the warm-up: the
fastest is the time (the least disturbed), the spread of the median over it the measured noise
that the choice of checkpointing compares against (one step's time on a shared CPU varies by
far more than 5%)."""

EXPECTED_FAKE_STEPS = 6
"""Fake steps an estimate usually takes: its warm-up, micro-batch 1, 64, then a few secant steps
to the boundary (5 to 8 for the benchmark's models)."""


class Prober:
    """One probe's search over real trials: which size to try next, from what the trials showed
    (:class:`TrialLog`), and the profile at the end; :meth:`run` does it. The trials themselves
    are a :class:`TrialRunner`'s. Not public: use :func:`probe`.
    """

    def __init__(
        self, step: StepSpec, options: ProbeOptions, *, optimizer: torch.optim.Optimizer
    ) -> None:
        self.step = step
        self.options = options
        self.optimizer = optimizer
        self.log = TrialLog()
        self.runner = TrialRunner(step, options, optimizer=optimizer, log=self.log)
        if self._estimate_refusal() is None:
            self.runner.static_bytes_hint = self._fake_static_bytes
        self.estimated = False
        """An estimate started the search (even if later found unreliable)."""
        self._warm_up_line: MemoryModel | None = None
        """The line from the resident bytes through the warm-up's peak: the search's prior where no
        estimate gives one (:func:`~autobatch.probing._search.warm_up_line`)."""
        self._started = options.device.clock()

    def run(self) -> Profile:
        if self.options.compiled == "measured":
            self.log.notes.append(
                "torch.compile: the trials ran the compiled step, its batch dimension dynamic "
                "(one graph for every size above 1); that graph stays in the model's compile "
                "cache and training reuses it (torch._dynamo.reset() before training compiles "
                "one of static shape)"
            )
        if self.options.compiled != "confirmed":
            return self._search()
        # Memory is counted with a dispatch mode: trials run the step eagerly (Dynamo untouched),
        # then one compiled step at the chosen size shows that it compiles and runs.
        with eager():
            profile = self._search()
        self.runner.confirm_compiled(profile.recommended_micro_batch_size)
        return dataclasses.replace(
            profile, num_steps=self.log.num_steps, notes=tuple(self.log.notes)
        )

    def confirm(self, size: int, prior: MemoryModel) -> tuple[Trial, Profile | None]:
        """Warm up (when the optimizer has no state yet), then one real trial at ``size``."""
        if self.options.compiled != "confirmed":
            return self._confirm(size, prior)
        with eager():
            trial, profile = self._confirm(size, prior)
        if profile is None:
            return trial, None
        self.runner.confirm_compiled(size)
        return trial, dataclasses.replace(
            profile, num_steps=self.log.num_steps, notes=tuple(self.log.notes)
        )

    def time_at(self, size: int) -> list[Trial]:
        """Warm up (when the optimizer has no state yet), then :data:`TIMED_STEPS` timed real
        trials at ``size`` (fewer when one does not fit: the rest are not run); every trial
        that ran, the timed ones last."""
        with eager() if self.options.compiled == "confirmed" else contextlib.nullcontext():
            self.runner.start()
            if self.runner.needs_state() and not self.optimizer.state:
                self._stage("warm-up", max_trials=1 + TIMED_STEPS)
                self.runner.warm_up()
            self._stage("timing", max_trials=len(self.log.trials) + TIMED_STEPS)
            self.runner.trial(size)
            for _ in range(TIMED_STEPS - 1):
                if not self.log.trials[-1].fits:
                    break
                self.runner.trial(size, repeat=True)
        return list(self.log.trials)

    def _confirm(self, size: int, prior: MemoryModel) -> tuple[Trial, Profile | None]:
        agreed_capacity = self.runner.start()
        if self.runner.needs_state() and not self.optimizer.state:
            self._stage("warm-up", max_trials=3)
            self.runner.warm_up()
        self._stage("confirm", max_trials=2)
        self.runner.trial(size)
        if self.log.trials[-1].fits:
            self._second_step(size)
        trial = self.log.trials[-1]
        if not trial.fits:
            return trial, None
        stop = (
            f"{CONFIRMATION_STOP_REASON}micro-batch {size}, predicted from another card, fits here"
        )
        # The boundary is the prediction's (from the other card's line), not this trial's limit.
        profile = self._profile(agreed_capacity, prior, size, stop, "boundary")
        return trial, profile if profile.recommended_micro_batch_size == size else None

    def _search(self) -> Profile:
        agreed_capacity = self.runner.start()
        if (
            self.runner.needs_state()
            and not self.options.consensus.min_ints([int(bool(self.optimizer.state))])[0]
        ):
            self._stage("warm-up")
            self.runner.warm_up()
        self._warm_up_line = warm_up_line(
            self.log.points,
            warm_up_peak_bytes=self.log.warm_up_peak_bytes,
            fixed_bytes=resident_bytes(self.step.model, self.optimizer),
        )
        self.log.prior, first = self._estimate(agreed_capacity)
        self.estimated = self.log.prior is not None
        size = self.runner.agree_size(first) if first is not None else self._next_size()
        self._stage("trials")
        while True:
            while size is not None:
                self.runner.trial(size)
                size = self._next_size()
            lo, hi = bracket(self.log.points)
            if lo == 0:
                self.runner.does_not_fit()
            self._stage("confirm")
            if self._second_step(lo):
                break
            self._stage("trials")  # the second step did not fit: the search goes on below
            size = self._next_size()
        self._compare_with_estimate()
        if lo >= self.options.search_limit:
            stop_reason = f"limit max_micro_batch_size={self.options.search_limit} reached"
        elif hi == self.log.failed_micro_batch_size:
            failed = next(t for t in self.log.trials if t.micro_batch_size == hi)
            stop_reason = f"micro-batch {hi} failed for a reason other than memory ({failed.error})"
        else:
            stop_reason = f"micro-batch {hi} does not fit"
        kind: StopKind = (
            "failure"
            if self.log.failed_micro_batch_size
            else "limit"
            if lo >= self.options.search_limit
            else "boundary"
        )
        profile = self._profile(agreed_capacity, self.log.prior, lo, stop_reason, kind)
        if profile.failure_note:
            profile = dataclasses.replace(profile, notes=(*profile.notes, profile.failure_note))
        return profile

    def _stage(self, stage: Stage, *, max_trials: int | None = None) -> None:
        """Tell the display a stage starts; ``max_trials`` defaults to the search's bound."""
        if self.options.on_stage is None:
            return
        if max_trials is None:
            max_trials = trial_budget(self.options.search_limit) + 2
        self.options.on_stage(
            ProbeStage(
                stage=stage,
                max_trials=max_trials,
                trials_run=len(self.log.trials),
                checkpointing_mode=self.options.checkpointing_mode,
            )
        )

    def _next_size(self) -> int | None:
        """The next size to try, agreed by the ranks (None: the search is over)."""
        return self.runner.agree_size(
            next_micro_batch_size(
                self.log.points,
                capacity_bytes=self.runner.agreed_capacity.capacity_bytes,
                limit=self.options.search_limit,
                prior=self._warm_up_line if self.log.prior is None else self.log.prior,
            )
        )

    def _second_step(self, size: int) -> bool:
        """Run the chosen ``size`` again: the first steps of a run differ (cuDNN benchmarking
        workspaces, allocator warm-up), so it stays chosen only if a second step fits too.

        Returns:
            Whether it fitted again.
        """
        self.runner.trial(size, repeat=True)
        fits = bracket(self.log.points)[0] >= size
        if not fits:
            self.log.notes.append(
                f"micro-batch {size} fitted at its first step but not at its second "
                f"({self.log.trials[-1].error}): the first steps of a run differ (cuDNN "
                "benchmarking, allocator warm-up), so it is not chosen"
            )
        return fits

    def _estimate_refusal(self) -> str | None:
        """Why the estimate cannot be used for this probe (a note), None when it can."""
        if not self.options.use_estimate:
            return "estimate not used (use_estimate=False): doubling-then-bisect"
        if self.options.eval:
            return (
                "estimate not used: the estimate traces a training step; the evaluation "
                "micro-batch was found by doubling-then-bisect"
            )
        if self.step.step_includes_update:
            # The train_step steps the user's own optimizer, over the real parameters: on a fake
            # copy of the model it would create no optimizer state, and the estimate would be low.
            return (
                "estimate not used: a train_step that updates by itself (step_includes_update) "
                "cannot run on a fake copy of the model; used doubling-then-bisect"
            )
        if self.options.layout:
            return (
                f"estimate not used: the step of a model sharded with {self.options.layout} runs "
                "collectives, which a fake copy cannot; used doubling-then-bisect"
            )
        return None

    def _fake_step(self) -> FakeStep:
        return FakeStep(
            self.step.model,
            self.optimizer,
            self.step.source,
            loss_fn=self.step.loss_fn,
            train_step=self.step.train_step,
            step_includes_update=self.step.step_includes_update,
            amp_dtype=self.step.amp_dtype,
            clock=self.options.clock,
        )

    def _fake_static_bytes(self) -> int:
        """Resident bytes after one fake step (weights, optimizer state); 0 when it cannot run."""
        try:
            with process_groups_faked():
                fake = self._fake_step()
                fake.warm_up()
        except (EstimateUnavailableError, PeerObjectError):
            return 0
        return sum(t.untyped_storage().nbytes() for t in fake.resident())

    def _estimate(self, capacity: Capacity) -> tuple[MemoryModel | None, int | None]:
        """Prior memory line and first size to try, from fake tensors (None, None without)."""
        refusal = self._estimate_refusal()
        if refusal is not None:
            self.log.notes.append(refusal)
            return None, None
        timed = zip(self.log.trials, self.log.trial_seconds, strict=True)
        real_step_seconds = next((s for t, s in timed if t.warm_up), None)
        budget = (
            None
            if real_step_seconds is None
            else estimate_budget_seconds(
                limit=self.options.search_limit,
                real_step_seconds=real_step_seconds,
                steps_scale_with_size=self.options.device.steps_scale_with_size,
                capacity_bytes=capacity.capacity_bytes,
                line=self._warm_up_line,
            )
        )
        if budget is not None:
            num_tensors = sum(1 for _ in self.step.model.parameters())
            predicted = EXPECTED_FAKE_STEPS * FAKE_STEP_SECONDS_PER_TENSOR * num_tensors
            # Every rank takes the same road (the fake steps run no collective, the real do).
            if not self.options.consensus.min_ints([int(predicted <= budget)])[0]:
                self.log.notes.append(
                    f"estimate not run: its {EXPECTED_FAKE_STEPS} fake steps would take about "
                    f"{predicted:.3g} s (predicted: {FAKE_STEP_SECONDS_PER_TENSOR * 1000:g} ms "
                    f"per parameter tensor, {num_tensors} tensors), more than the "
                    f"{budget:.3g} s of real steps it can save (a real step took "
                    f"{real_step_seconds:.3g} s); searched with real steps"
                )
                return None, None
        self._stage("estimate")
        started = self.options.clock()
        try:
            # The fake steps' collectives on real tensors (an object collective pickles into
            # one) would reach the other ranks, which may estimate differently: none leaves.
            with process_groups_faked():
                fake = self._fake_step()
                points = estimate_points(
                    fake,
                    capacity_bytes=capacity.capacity_bytes,
                    search_limit=self.options.search_limit,
                    budget_seconds=None if budget is None else ESTIMATE_OVERRUN * budget,
                )
        except (EstimateUnavailableError, PeerObjectError) as exc:  # the warm-up raises it
            self.log.estimate_seconds = self.options.clock() - started
            self.log.notes.append(f"estimate unavailable ({exc}); used doubling-then-bisect")
            return None, None
        self.log.estimate_seconds = self.options.clock() - started
        self.log.fake_step_seconds = list(fake.step_seconds)
        self.log.estimated_static_bytes = sum(t.untyped_storage().nbytes() for t in fake.resident())
        lo, hi = bracket(points)
        prior = fit_wide_line(points)
        first: int | None = max(lo, 1)
        if fake.stopped_early:
            first = lo if lo > 1 else None  # None: the search proposes
            if prior is not None:  # the line so far proposes; the safeguarded search checks
                top = self.options.search_limit if hi is None else hi - 1
                predicted = prior.max_micro_batch_size(capacity.capacity_bytes)
                first = max(first or 1, min(predicted, top))
            self.log.notes.append(
                f"estimate stopped after {fake.num_steps} fake steps ({sum(fake.step_seconds):.3g}"
                f" s), at {ESTIMATE_OVERRUN:g}x the {budget:.3g} s of real steps it saves (a real "
                f"step took {real_step_seconds:.3g} s): micro-batch {lo} fits, the search starts "
                f"at {first or 'its own proposal'}"
            )
        else:
            self.log.notes.append(
                f"estimate: micro-batch {lo} fits in {format_bytes(capacity.capacity_bytes)} "
                f"({fake.num_steps} fake steps)"
            )
        del fake
        return prior, first

    def _compare_with_estimate(self) -> None:
        """One note setting the estimated peak beside the measured one at each confirmed size;
        a size trialled again with the same peak is named once."""
        compared = [t for t in self.log.trials if t.estimate_error is not None]
        entries = dict.fromkeys(
            f"micro-batch {t.micro_batch_size}: {format_bytes(t.estimated_peak_bytes)} vs "
            f"{format_bytes(t.peak_allocated_bytes)} ({t.estimate_error:+.1%})"
            for t in compared
        )
        if entries:
            self.log.notes.append("estimated vs measured peak: " + "; ".join(entries))

    def _profile(
        self,
        capacity: Capacity,
        prior: MemoryModel | None,
        largest: int,
        stop_reason: str,
        stop_kind: StopKind,
    ) -> Profile:
        # The profile's line predicts across the range (the recommended size under the margin,
        # plans): through peaks far apart, not the search's secant through its two latest
        # (often adjacent sizes, tilted by allocator rounding).
        line = fit_wide_line(self.log.points, prior)
        skipped = sorted({t.micro_batch_size for t in self.log.trials if t.skipped_optimizer_step})
        if skipped:
            self.log.notes.append(
                f"train_step did not step the optimizer in the trials at micro-batch "
                f"{', '.join(map(str, skipped))} (it accumulates by itself): their peaks lack "
                "the update's temporaries; the optimizer state was present"
            )
        return Profile(
            max_micro_batch_size=largest,
            recommended_micro_batch_size=recommended_size(
                self.log.points,
                capacity_bytes=capacity.capacity_bytes,
                safety_margin=self.options.safety_margin,
                model=line,
                warm_up_peak_bytes=self.log.warm_up_peak_bytes,
            ),
            safety_margin=self.options.safety_margin,
            method="probe" if self.estimated or prior is not None else "doubling",
            trials=tuple(self.log.trials),
            num_steps=self.log.num_steps,
            device_name=self.options.device.name,
            device_type=self.options.device.type,
            total_memory_bytes=capacity.total_memory_bytes,
            capacity_bytes=capacity.capacity_bytes,
            foreign_memory_bytes=capacity.foreign_memory_bytes,
            memory_model=line,
            stop_kind=stop_kind,
            stop_reason=stop_reason,
            notes=tuple(self.log.notes),
            driver_version=self.options.device.driver_version,
            identity=self.step.identity,
            model_name=self.step.model_name,
            failed_micro_batch_size=self.log.failed_micro_batch_size,
            mode="eval" if self.options.eval else "train",
            compiled=self.options.compiled,
            created_at=now_iso(),
            budget=capacity.budget,
            # The optimizer's state exists now (the warm-up made it): its bytes by dtype.
            conditions=with_optimizer_state(self.options.conditions, self.optimizer),
            gradient_sync=self.options.gradient_sync,
            node_name=node_name(),
            activation_checkpointing=self.options.checkpointing_mode,
            timings=self._timings(),
        )

    def _timings(self) -> ProbeTimings:
        """The time so far by part, on the device's clock."""
        device = self.options.device
        simulated = isinstance(device, SimulatedDevice) and device.step_seconds is not None
        return ProbeTimings(
            total_seconds=max(0.0, device.clock() - self._started),
            estimate_seconds=max(0.0, self.log.estimate_seconds),
            fake_step_seconds=tuple(self.log.fake_step_seconds),
            trial_seconds=tuple(self.log.trial_seconds),
            cleanup_seconds=tuple(self.log.cleanup_seconds),
            clock="simulated" if simulated else "wall",
        )


def default_optimizer(model: torch.nn.Module, *, evaluating: bool) -> torch.optim.Optimizer:
    """An AdamW over the trainable parameters, for a probe given no optimizer.

    An evaluation without an optimizer never steps it and needs no optimizer state (only the
    weights are resident), so a frozen model gets one over all its parameters, left without state.

    Raises:
        ConfigError: a training probe of a model with no trainable parameter, or a model with no
            parameter at all.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params and evaluating:
        params = list(model.parameters())
    if not params:
        raise ConfigError(
            f"model {type(model).__name__} has no trainable parameter (requires_grad=True); "
            "there is no training step to probe"
            if not evaluating
            else f"model {type(model).__name__} has no parameter; there are no weights to probe"
        )
    return torch.optim.AdamW(params)
