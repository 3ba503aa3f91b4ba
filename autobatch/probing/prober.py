"""The probe: the largest micro-batch whose whole training step fits, in few real trials.

1. **Capacity** from the device (CUDA: NVML free + torch reserved, capped by the per-process
   fraction; simulated: its capacity less foreign bytes).
2. **Warm-up**: one real step at micro-batch 1 creates the optimizer state (so every measured step
   runs with it, as in training) and says what a real step costs here.
3. **Estimate** on fake tensors (:mod:`autobatch.probing.estimator`): a predicted size and a memory
   line, with nothing allocated, *when it pays*. The rule: the estimate may cost what it saves,
   the real steps the search runs without it before two measured peaks give it a line (at
   micro-batch 4 and 16), priced from the warm-up's measured time: that time each where a
   step's time stays near it (a GPU's small steps, a simulated card's set cost), that time the
   size where it grows with the size (a CPU;
   :func:`~autobatch.probing.search.estimate_budget_seconds`). It does not start when
   :data:`EXPECTED_FAKE_STEPS` fake steps of the predicted length
   (:data:`FAKE_STEP_SECONDS_PER_TENSOR` per parameter tensor) would cost more, and it stops
   before a fake step that would take it past :data:`ESTIMATE_OVERRUN` times that (the mean of
   its steps so far as the next one's length); what it found by then still guides the search.
   On a CPU, where a real step is dear, it runs; on a GPU, where a real step takes milliseconds
   and a fake one the same CPU time as anywhere, the search goes on with real steps. Without a
   warm-up (the optimizer already has state) no real step was timed and the estimate runs.
   When the step cannot run on fake tensors the probe says so in the profile's notes and falls
   back to doubling-then-bisect.
4. **Confirm and bisect** with real steps (:mod:`autobatch.probing.search`): typically the
   predicted size, and one size above it. The search is safeguarded: whatever the
   peaks and the estimate say, it finds the exact max within ``ceil(log2(limit)) + 3`` trials
   besides the warm-up. Each measured peak is set beside the estimate's; an estimate off by more
   than :data:`UNRELIABLE_ESTIMATE` is said so in the notes and no longer steers the search.
5. **OOM** (classified by :func:`autobatch.device.oom.is_oom`) marks a size too big; after it, no
   reference to the failed step survives (gradients dropped, ``gc.collect()`` then the allocator
   cache emptied). Any other exception is not OOM: at the first trial it is re-raised as
   :class:`~autobatch.errors.StepFailedError`; later it is an upper bound (a kernel's launch
   limit, say): the search goes on below it, and the profile names the size and the error.
6. **Leave no trace** (:mod:`autobatch.probing.snapshot`): parameters, buffers, gradients,
optimizer state,
   train/eval flags and RNG states are restored bitwise.
7. **Ranks agree** through a :class:`Consensus` (one process: :class:`LocalConsensus`; under
   torch.distributed: :class:`autobatch.distributed.consensus.ProcessGroupConsensus`): every rank
   runs the
   same sizes in the same order, a size fits only if it fits on every rank (the capacity searched
   is the smallest rank's), a non-OOM failure on one rank is an upper bound for all of them, and
   a failure that ends the probe (at the first size) ends it on every rank.

Example::

    profile = autobatch.probe(model, (inputs, targets), loss_fn=F.cross_entropy, device="sim:2GiB")
    profile.max_micro_batch_size, profile.recommended_micro_batch_size, profile.num_trials
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from autobatch.device import Capacity, Device, SimulatedDevice, node_name, resolve_device
from autobatch.distributed.consensus import Consensus
from autobatch.distributed.fake_backend import process_groups_faked, reshard_fsdp2
from autobatch.errors import ConfigError, EstimateUnavailableError, PeerObjectError
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.probing.compiled import eager
from autobatch.probing.conditions import with_optimizer_state
from autobatch.probing.estimator import FakeStep, estimate_points
from autobatch.probing.identity import now_iso
from autobatch.probing.options import DEFAULT_LIMIT, OnTrial, ProbeOptions, StepSpec
from autobatch.probing.parallel import trial_context
from autobatch.probing.placement import model_device
from autobatch.probing.search import (
    bracket,
    estimate_budget_seconds,
    fit_wide_line,
    next_micro_batch_size,
    recommended_size,
)
from autobatch.probing.snapshot import Snapshot, objects_frozen
from autobatch.probing.step import LossFn, TrainStep
from autobatch.probing.trials import TrialLog, TrialRunner
from autobatch.probing.worst_case import WorstCaseSample
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
    "Prober",
    "probe",
    "run_confirmation",
    "run_probe",
]

T = TypeVar("T")

FAKE_STEP_SECONDS_PER_TENSOR = 0.006
"""Predicted seconds of one fake step per parameter tensor of the model, before any fake step has
run. A fake step dispatches every op on the host whatever the device, so its cost grows with the
number of tensors the step touches rather than with the model's FLOPs; ``bench/probe_vs_peers.py``
prints the per-tensor cost it sees. A prediction only: the estimate's own steps replace it once
the first has run."""

ESTIMATE_OVERRUN = 2.0
"""A started estimate stops before a fake step that would take it past this many times its
budget (:func:`~autobatch.probing.search.estimate_budget_seconds`). Its start was judged on a
predicted length (:data:`FAKE_STEP_SECONDS_PER_TENSOR`), which can be off by about 2x either way,
and an estimate stopped short of the memory's edge is worth little: the search then pays real
trials for what a few more fake steps would have found. 2x lets an estimate that was judged
worth starting finish, while bounding what a wrong prediction can cost."""

EXPECTED_FAKE_STEPS = 6
"""Fake steps an estimate usually takes: its warm-up, micro-batch 1, 64, then a few secant steps
to the boundary (5 to 8 for the benchmark's models)."""


def probe(
    model: torch.nn.Module,
    sample: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    device: str | Device | None = None,
    gpu_fraction: float | None = None,
    amp_dtype: torch.dtype | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    max_micro_batch_size: int = DEFAULT_LIMIT,
    use_estimate: bool = True,
    on_trial: OnTrial | None = None,
    consensus: Consensus | None = None,
    eval: bool = False,
) -> Profile:
    """Find the largest micro-batch whose whole training step fits on ``device``.

    Args:
        model: the model, on the device to probe (CPU for ``"sim:SIZE"``).
        sample: one batch (a tensor, or a tuple/list/dict of tensors, batch dimension first) or a
            callable ``n -> batch``; micro-batches of any size are built from it.
        optimizer: stepped in each trial and restored afterwards; when None, an AdamW over the
            trainable parameters is used (and discarded).
        loss_fn, train_step, step_includes_update: how the sample becomes a step; see
            :mod:`autobatch.probing.step`.
        device: ``"cuda:N"``, ``"cpu"``, ``"sim:SIZE"`` or a :class:`~autobatch.device.Device`;
            None means the model's device. Its memory budget is the smallest of every source
            it can see (NVML, the CUDA runtime, vGPU limits, fractions, the cgroup; see
            :mod:`autobatch.device.budget`), recorded on the profile (``budget``).
        gpu_fraction: the share of a GPU this job is declared to get, in (0, 1] (Ray's
            ``num_gpus=0.5``: 0.5): the budget is at most that share of the card's memory. None
            for the whole card.
        amp_dtype: autocast dtype for forward and loss (float16 also scales the loss with a
            GradScaler), None for full precision.
        safety_margin: fraction of the capacity the recommended size keeps free, in [0, 1); the
            default 5% absorbs fragmentation and small input-shape changes.
        max_micro_batch_size: largest size tried (>= 1).
        use_estimate: start from a fake-tensor estimate (False: doubling-then-bisect).
        on_trial: called after each real trial (progress display).
        consensus: how data-parallel ranks agree (every rank calls :func:`probe` with its own
            device); None for a single process. See
            :class:`autobatch.distributed.consensus.ProcessGroupConsensus`.
        eval: probe the evaluation micro-batch instead: each trial is a forward (and the loss
            when the step's form gives one) under ``torch.inference_mode`` with the model in eval
            mode. With an ``optimizer``, its state is resident as during training (one training
            step at the smallest size creates it when it has none); without one, only the
            weights are. No estimate: doubling-then-bisect.

    Returns:
        The Profile (``method="probe"``, or ``"doubling"`` without an estimate; ``mode="eval"``
        with ``eval=True``, whose ``recommended_micro_batch_size`` is the evaluation
        micro-batch).

    Raises:
        ConfigError: bad arguments, an empty or inconsistent sample, model and sample (or device)
            on different devices, a step whose loss cannot be computed, ``eval=True`` with a
            ``train_step`` that updates by itself.
        DoesNotFitError: the step runs out of memory even at micro-batch 1 (names the device, its
            capacity and the model's static footprint).
        StepFailedError: the first trial failed for a reason other than memory (the original
            exception is its ``__cause__``).
        DeviceUnavailableError: the device cannot be queried.
        DistributedError: another rank's first trial failed for a reason other than memory (that
            rank raises StepFailedError or ConfigError).
    """
    step = StepSpec.build(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_step=train_step,
        step_includes_update=step_includes_update,
        amp_dtype=amp_dtype,
    )
    options = ProbeOptions.build(
        step,
        device=resolve_device(device, default=model_device(model), gpu_fraction=gpu_fraction),
        safety_margin=safety_margin,
        max_micro_batch_size=max_micro_batch_size,
        use_estimate=use_estimate,
        on_trial=on_trial,
        eval=eval,
        consensus=consensus,
    )
    return run_probe(step, options)


def run_probe(step: StepSpec, options: ProbeOptions) -> Profile:
    """:func:`probe` on bundles already checked (the tuning road's entry, which builds them once).

    Raises:
        As :func:`probe`.
    """
    profile = _probing(step, options, lambda search: search.run())
    if isinstance(step.sample, WorstCaseSample):  # the profile records the load it measured
        profile = dataclasses.replace(profile, notes=(*profile.notes, step.sample.describe()))
    return profile


def run_confirmation(
    step: StepSpec, options: ProbeOptions, *, micro_batch_size: int, prior: MemoryModel
) -> tuple[Trial, Profile | None]:
    """One real trial at a predicted ``micro_batch_size`` (after the warm-up step that creates the
    optimizer state), leaving no trace, as :func:`probe` does.

    Args:
        step, options: as the probe's; ``options.max_micro_batch_size`` is ignored (the trial's
            size is the limit).
        micro_batch_size: the size to confirm (>= 1), e.g. a plan predicted from another card.
        prior: the memory line the prediction came from; the returned profile's line has its
            slope through the confirmed peak.

    Returns:
        The confirming trial, and the Profile it makes for this device when it confirms the
        prediction (the step fits and its peak keeps ``safety_margin`` of the capacity free);
        None otherwise (the trial's ``error`` or peak says why).

    Raises:
        ConfigError, DoesNotFitError, StepFailedError, DeviceUnavailableError: as for
            :func:`probe`.
    """
    return _probing(
        step,
        dataclasses.replace(options.with_limit(micro_batch_size), use_estimate=False),
        lambda search: search.confirm(micro_batch_size, prior),
    )


def _probing(step: StepSpec, options: ProbeOptions, run: Callable[[Prober], T]) -> T:
    """Snapshot what a probe must leave as it was, ``run`` a :class:`Prober`, and restore."""
    model, optimizer = step.model, step.optimizer
    # A collection after every trial walks only what the probe created, not the whole process
    # (torch, a framework): objects that exist now are frozen until the probe ends.
    with objects_frozen():
        reshard_fsdp2(model)  # a snapshot of unsharded FSDP2 parameters would outlive them
        snapshot = Snapshot.take(model, optimizer)
        run_optimizer = (
            optimizer
            if optimizer is not None
            else _default_optimizer(model, evaluating=options.eval)
        )
        try:
            model.train()
            for param in model.parameters():
                param.grad = None
            search = Prober(step, options, optimizer=run_optimizer)
            with trial_context(
                model,
                options.layout,
                device=options.device.torch_device,
                world_size=options.consensus.world_size,
                notes=search.log.notes,
            ):
                return run(search)
        finally:
            del run_optimizer
            reshard_fsdp2(model)
            snapshot.restore()
            del snapshot
            options.device.release()


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

    def _confirm(self, size: int, prior: MemoryModel) -> tuple[Trial, Profile | None]:
        agreed_capacity = self.runner.start()
        if self.runner.needs_state() and not self.optimizer.state:
            self.runner.warm_up()
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
            self.runner.warm_up()
        self.log.prior, first = self._estimate(agreed_capacity)
        self.estimated = self.log.prior is not None
        size = self.runner.agree_size(first) if first is not None else self._next_size()
        while True:
            while size is not None:
                self.runner.trial(size)
                size = self._next_size()
            lo, hi = bracket(self.log.points)
            if lo == 0:
                self.runner.does_not_fit()
            if self._second_step(lo):
                break
            size = self._next_size()
        self._compare_with_estimate()
        if lo >= self.options.max_micro_batch_size:
            stop_reason = f"limit max_micro_batch_size={self.options.max_micro_batch_size} reached"
        elif hi == self.log.failed_micro_batch_size:
            failed = next(t for t in self.log.trials if t.micro_batch_size == hi)
            stop_reason = f"micro-batch {hi} failed for a reason other than memory ({failed.error})"
        else:
            stop_reason = f"micro-batch {hi} does not fit"
        kind: StopKind = (
            "failure"
            if self.log.failed_micro_batch_size
            else "limit"
            if lo >= self.options.max_micro_batch_size
            else "boundary"
        )
        profile = self._profile(agreed_capacity, self.log.prior, lo, stop_reason, kind)
        if profile.failure_note:
            profile = dataclasses.replace(profile, notes=(*profile.notes, profile.failure_note))
        return profile

    def _next_size(self) -> int | None:
        """The next size to try, agreed by the ranks (None: the search is over)."""
        return self.runner.agree_size(
            next_micro_batch_size(
                self.log.points,
                capacity_bytes=self.runner.agreed_capacity.capacity_bytes,
                limit=self.options.max_micro_batch_size,
                prior=self.log.prior,
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
                limit=self.options.max_micro_batch_size,
                real_step_seconds=real_step_seconds,
                steps_scale_with_size=self.options.device.steps_scale_with_size,
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
        started = self.options.device.clock()
        try:
            # The fake steps' collectives on real tensors (an object collective pickles into
            # one) would reach the other ranks, which may estimate differently: none leaves.
            with process_groups_faked():
                fake = self._fake_step()
                points = estimate_points(
                    fake,
                    capacity_bytes=capacity.capacity_bytes,
                    max_micro_batch_size=self.options.max_micro_batch_size,
                    budget_seconds=None if budget is None else ESTIMATE_OVERRUN * budget,
                )
        except (EstimateUnavailableError, PeerObjectError) as exc:  # the warm-up raises it
            self.log.estimate_seconds = self.options.device.clock() - started
            self.log.notes.append(f"estimate unavailable ({exc}); used doubling-then-bisect")
            return None, None
        self.log.estimate_seconds = self.options.device.clock() - started
        self.log.fake_step_seconds = list(fake.step_seconds)
        self.log.estimated_static_bytes = sum(t.untyped_storage().nbytes() for t in fake.resident())
        lo, hi = bracket(points)
        prior = fit_wide_line(points)
        first: int | None = max(lo, 1)
        if fake.stopped_early:
            first = lo if lo > 1 else None  # None: the search proposes
            if prior is not None:  # the line so far proposes; the safeguarded search checks
                top = self.options.max_micro_batch_size if hi is None else hi - 1
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
        """One note setting the estimated peak beside the measured one at each confirmed size."""
        compared = [t for t in self.log.trials if t.estimate_error is not None]
        if compared:
            self.log.notes.append(
                "estimated vs measured peak: "
                + "; ".join(
                    f"micro-batch {t.micro_batch_size}: {format_bytes(t.estimated_peak_bytes)} vs "
                    f"{format_bytes(t.peak_allocated_bytes)} ({t.estimate_error:+.1%})"
                    for t in compared
                )
            )

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
            failed_micro_batch_size=self.log.failed_micro_batch_size,
            mode="eval" if self.options.eval else "train",
            compiled=self.options.compiled,
            created_at=now_iso(),
            budget=capacity.budget,
            # The optimizer's state exists now (the warm-up made it): its bytes by dtype.
            conditions=with_optimizer_state(self.options.conditions, self.optimizer),
            gradient_sync=self.options.gradient_sync,
            node_name=node_name(),
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


def _default_optimizer(model: torch.nn.Module, *, evaluating: bool) -> torch.optim.Optimizer:
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
