"""The probe: the largest micro-batch whose whole training step fits, in few real trials.

1. **Capacity** from the device (CUDA: NVML free + torch reserved, capped by the per-process
   fraction; simulated: its capacity less foreign bytes).
2. **Estimate** on fake tensors (:mod:`autobatch.probing.estimator`): a predicted size and a memory
line,
   with nothing allocated. When the step cannot run on fake tensors the probe says so in the
   profile's notes and falls back to doubling-then-bisect.
3. **Confirm and bisect** with real steps (:mod:`autobatch.probing.search`): typically a warm-up at
   micro-batch 1 (creates the optimizer state, so every measured step runs with it, as in
   training), the predicted size, and one size above it. The search is safeguarded: whatever the
   peaks and the estimate say, it finds the exact max within ``ceil(log2(limit)) + 3`` trials
   besides the warm-up. Each measured peak is set beside the estimate's; an estimate off by more
   than :data:`UNRELIABLE_ESTIMATE` is said so in the notes and no longer steers the search.
4. **OOM** (classified by :func:`autobatch.device.oom.is_oom`) marks a size too big; after it, no
   reference to the failed step survives (gradients dropped, ``gc.collect()`` then the allocator
   cache emptied). Any other exception is not OOM: at the first trial it is re-raised as
   :class:`~autobatch.errors.StepFailedError`; later it is an upper bound (a kernel's launch
   limit, say): the search goes on below it, and the profile names the size and the error.
5. **Leave no trace** (:mod:`autobatch.probing.snapshot`): parameters, buffers, gradients,
optimizer state,
   train/eval flags and RNG states are restored bitwise.
6. **Ranks agree** through a :class:`Consensus` (one process: :class:`LocalConsensus`; under
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

from autobatch.device import Capacity, Device, resolve_device
from autobatch.distributed.consensus import Consensus, LocalConsensus
from autobatch.distributed.fake_backend import process_groups_faked, reshard_fsdp2
from autobatch.distributed.layout import collective_layout
from autobatch.errors import ConfigError, EstimateUnavailableError, PeerObjectError
from autobatch.probing.batch import BatchSource
from autobatch.probing.compiled import eager
from autobatch.probing.estimator import (
    DEFAULT_LIMIT,
    FakeStep,
    check_search_arguments,
    estimate_points,
)
from autobatch.probing.identity import now_iso
from autobatch.probing.parallel import device_for_layout, trial_context
from autobatch.probing.placement import check_placement, model_device
from autobatch.probing.search import (
    bracket,
    fit_memory_model,
    fit_wide_line,
    next_micro_batch_size,
    recommended_size,
)
from autobatch.probing.snapshot import Snapshot, objects_frozen
from autobatch.probing.step import LossFn, TrainStep, check_step_arguments
from autobatch.probing.trials import MAX_WARM_UP_CALLS, UNRELIABLE_ESTIMATE, OnTrial, TrialRunner
from autobatch.probing.worst_case import WorstCaseSample
from autobatch.profile import MemoryModel, Profile, StopKind, Trial
from autobatch.units import format_bytes

__all__ = [
    "MAX_WARM_UP_CALLS",
    "UNRELIABLE_ESTIMATE",
    "Consensus",
    "LocalConsensus",
    "confirm_micro_batch_size",
    "probe",
]

T = TypeVar("T")


def probe(
    model: torch.nn.Module,
    sample: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    device: str | Device | None = None,
    amp_dtype: torch.dtype | None = None,
    safety_margin: float = 0.05,
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
            None means the model's device.
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
    check_search_arguments(max_micro_batch_size, safety_margin)
    profile = _probing(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_step=train_step,
        step_includes_update=step_includes_update,
        device=device,
        amp_dtype=amp_dtype,
        safety_margin=safety_margin,
        limit=max_micro_batch_size,
        use_estimate=use_estimate,
        on_trial=on_trial,
        consensus=consensus,
        evaluating=eval,
        run=lambda search: search.run(),
    )
    if isinstance(sample, WorstCaseSample):  # the profile records the load it measured
        profile = dataclasses.replace(profile, notes=(*profile.notes, sample.describe()))
    return profile


def confirm_micro_batch_size(
    model: torch.nn.Module,
    sample: Any,
    *,
    micro_batch_size: int,
    prior: MemoryModel,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    device: str | Device | None = None,
    amp_dtype: torch.dtype | None = None,
    safety_margin: float = 0.05,
    on_trial: OnTrial | None = None,
    eval: bool = False,
) -> tuple[Trial, Profile | None]:
    """One real trial at a predicted ``micro_batch_size`` (after the warm-up step that creates the
    optimizer state), leaving no trace, as :func:`probe` does.

    Args:
        micro_batch_size: the size to confirm (>= 1), e.g. a plan predicted from another card.
        prior: the memory line the prediction came from; the returned profile's line has its
            slope through the confirmed peak.
        model, sample, optimizer, loss_fn, train_step, step_includes_update, device, amp_dtype,
            safety_margin, on_trial, eval: as for :func:`probe`.

    Returns:
        The confirming trial, and the Profile it makes for this device when it confirms the
        prediction (the step fits and its peak keeps ``safety_margin`` of the capacity free);
        None otherwise (the trial's ``error`` or peak says why).

    Raises:
        ConfigError, DoesNotFitError, StepFailedError, DeviceUnavailableError: as for
            :func:`probe`.
    """
    check_search_arguments(micro_batch_size, safety_margin)
    return _probing(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_step=train_step,
        step_includes_update=step_includes_update,
        device=device,
        amp_dtype=amp_dtype,
        safety_margin=safety_margin,
        limit=micro_batch_size,
        use_estimate=False,
        on_trial=on_trial,
        consensus=None,
        evaluating=eval,
        run=lambda search: search.confirm(micro_batch_size, prior),
    )


def _probing(
    model: torch.nn.Module,
    sample: Any,
    *,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn | None,
    train_step: TrainStep | None,
    step_includes_update: bool,
    device: str | Device | None,
    amp_dtype: torch.dtype | None,
    safety_margin: float,
    limit: int,
    use_estimate: bool,
    on_trial: OnTrial | None,
    consensus: Consensus | None,
    evaluating: bool,
    run: Callable[[_Probe], T],
) -> T:
    """Check the arguments, snapshot what a probe must leave as it was, ``run`` a :class:`_Probe`,
    and restore."""
    check_step_arguments(
        model, optimizer, step_includes_update=step_includes_update, amp_dtype=amp_dtype
    )
    if evaluating and step_includes_update:
        raise ConfigError(
            "eval=True runs a forward under inference_mode, but a train_step that updates by "
            "itself (step_includes_update=True) runs backward and steps the optimizer; pass an "
            "evaluation step that returns the loss (or output), with step_includes_update=False"
        )
    target = resolve_device(device, default=model_device(model))
    source = BatchSource.from_sample(sample)
    check_placement(model, source, target)
    layout = collective_layout(model)
    if layout:
        target = device_for_layout(
            target, layout, world_size=None if consensus is None else consensus.world_size
        )
    # A collection after every trial walks only what the probe created, not the whole process
    # (torch, a framework): objects that exist now are frozen until the probe ends.
    with objects_frozen():
        reshard_fsdp2(model)  # a snapshot of unsharded FSDP2 parameters would outlive them
        snapshot = Snapshot.take(model, optimizer)
        run_optimizer = (
            optimizer if optimizer is not None else _default_optimizer(model, evaluating=evaluating)
        )
        try:
            model.train()
            for param in model.parameters():
                param.grad = None
            search = _Probe(
                model=model,
                optimizer=run_optimizer,
                user_optimizer=optimizer,
                source=source,
                device=target,
                loss_fn=loss_fn,
                train_step=train_step,
                step_includes_update=step_includes_update,
                amp_dtype=amp_dtype,
                safety_margin=safety_margin,
                limit=limit,
                use_estimate=use_estimate,
                on_trial=on_trial,
                consensus=consensus if consensus is not None else LocalConsensus(),
                layout=layout,
                evaluating=evaluating,
            )
            with trial_context(
                model,
                layout,
                device=target.torch_device,
                world_size=search.consensus.world_size,
                notes=search.notes,
            ):
                return run(search)
        finally:
            del run_optimizer
            reshard_fsdp2(model)
            snapshot.restore()
            del snapshot
            target.release()


class _Probe(TrialRunner):
    """One probe's search over its trials; :meth:`run` does it. Not public: use :func:`probe`."""

    # -- the search -------------------------------------------------------------------------

    def run(self) -> Profile:
        if self.compiled == "measured":
            self.notes.append(
                "torch.compile: the trials ran the compiled step, its batch dimension dynamic "
                "(one graph for every size above 1); that graph stays in the model's compile "
                "cache and training reuses it (torch._dynamo.reset() before training compiles "
                "one of static shape)"
            )
        if self.compiled != "confirmed":
            return self._search()
        # Memory is counted with a dispatch mode: trials run the step eagerly (Dynamo untouched),
        # then one compiled step at the chosen size shows that it compiles and runs.
        with eager():
            profile = self._search()
        self._confirm_compiled(profile.recommended_micro_batch_size)
        return dataclasses.replace(profile, num_steps=self.num_steps, notes=tuple(self.notes))

    def confirm(self, size: int, prior: MemoryModel) -> tuple[Trial, Profile | None]:
        """Warm up (when the optimizer has no state yet), then one real trial at ``size``."""
        if self.compiled != "confirmed":
            return self._confirm(size, prior)
        with eager():
            trial, profile = self._confirm(size, prior)
        if profile is None:
            return trial, None
        self._confirm_compiled(size)
        return trial, dataclasses.replace(
            profile, num_steps=self.num_steps, notes=tuple(self.notes)
        )

    def _confirm(self, size: int, prior: MemoryModel) -> tuple[Trial, Profile | None]:
        self.own_capacity = self.device.capacity()
        self.agreed_capacity = self._agree_capacity(self.own_capacity)
        if self._needs_state() and not self.optimizer.state:
            self._warm_up()
        self._trial(size)
        if self.trials[-1].fits:
            self._second_step(size)
        trial = self.trials[-1]
        if not trial.fits:
            return trial, None
        stop = f"confirmation: micro-batch {size}, predicted from another card, fits here"
        # The boundary is the prediction's (from the other card's line), not this trial's limit.
        profile = self._profile(self.agreed_capacity, prior, size, stop, "boundary")
        return trial, profile if profile.recommended_micro_batch_size == size else None

    def _search(self) -> Profile:
        own_capacity = self.own_capacity = self.device.capacity()
        agreed_capacity = self.agreed_capacity = self._agree_capacity(own_capacity)
        self.prior, first = self._estimate(agreed_capacity)
        self.estimated = self.prior is not None
        if (
            self._needs_state()
            and not self.consensus.min_ints([int(bool(self.optimizer.state))])[0]
        ):
            self._warm_up()
        size = self._agree_size(first) if first is not None else self._next_size()
        while True:
            while size is not None:
                self._trial(size)
                size = self._next_size()
            lo, hi = bracket(self.points)
            if lo == 0:
                self._does_not_fit()
            if self._second_step(lo):
                break
            size = self._next_size()
        self._compare_with_estimate()
        if lo >= self.limit:
            stop_reason = f"limit max_micro_batch_size={self.limit} reached"
        elif hi == self.failed_micro_batch_size:
            failed = next(t for t in self.trials if t.micro_batch_size == hi)
            stop_reason = f"micro-batch {hi} failed for a reason other than memory ({failed.error})"
        else:
            stop_reason = f"micro-batch {hi} does not fit"
        kind: StopKind = (
            "failure"
            if self.failed_micro_batch_size
            else "limit"
            if lo >= self.limit
            else "boundary"
        )
        profile = self._profile(agreed_capacity, self.prior, lo, stop_reason, kind)
        if profile.failure_note:
            profile = dataclasses.replace(profile, notes=(*profile.notes, profile.failure_note))
        return profile

    def _needs_state(self) -> bool:
        """Whether the measured steps need the optimizer state: every training step does; an
        evaluation does when it runs during training (an optimizer was given)."""
        return not self.evaluating or self.user_optimizer is not None

    def _next_size(self) -> int | None:
        """The next size to try, agreed by the ranks (None: the search is over)."""
        return self._agree_size(
            next_micro_batch_size(
                self.points,
                capacity_bytes=self.agreed_capacity.capacity_bytes,
                limit=self.limit,
                prior=self.prior,
            )
        )

    def _second_step(self, size: int) -> bool:
        """Run the chosen ``size`` again: the first steps of a run differ (cuDNN benchmarking
        workspaces, allocator warm-up), so it stays chosen only if a second step fits too.

        Returns:
            Whether it fitted again.
        """
        self._trial(size, repeat=True)
        fits = bracket(self.points)[0] >= size
        if not fits:
            self.notes.append(
                f"micro-batch {size} fitted at its first step but not at its second "
                f"({self.trials[-1].error}): the first steps of a run differ (cuDNN "
                "benchmarking, allocator warm-up), so it is not chosen"
            )
        return fits

    def _estimate(self, capacity: Capacity) -> tuple[MemoryModel | None, int | None]:
        """Prior memory line and first size to try, from fake tensors (None, None without)."""
        if not self.use_estimate:
            self.notes.append("estimate not used (use_estimate=False): doubling-then-bisect")
            return None, None
        if self.evaluating:
            self.notes.append(
                "estimate not used: the estimate traces a training step; the evaluation "
                "micro-batch was found by doubling-then-bisect"
            )
            return None, None
        if self.step_includes_update:
            # The train_step steps the user's own optimizer, over the real parameters: on a fake
            # copy of the model it would create no optimizer state, and the estimate would be low.
            self.notes.append(
                "estimate not used: a train_step that updates by itself (step_includes_update) "
                "cannot run on a fake copy of the model; used doubling-then-bisect"
            )
            return None, None
        if self.layout:
            self.notes.append(
                f"estimate not used: the step of a model sharded with {self.layout} runs "
                "collectives, which a fake copy cannot; used doubling-then-bisect"
            )
            return None, None
        try:
            # The fake steps' collectives on real tensors (an object collective pickles into
            # one) would reach the other ranks, which may estimate differently: none leaves.
            with process_groups_faked():
                fake = FakeStep(
                    self.model,
                    self.optimizer,
                    self.source,
                    loss_fn=self.loss_fn,
                    train_step=self.train_step,
                    step_includes_update=self.step_includes_update,
                    amp_dtype=self.amp_dtype,
                )
                points = estimate_points(
                    fake, capacity_bytes=capacity.capacity_bytes, max_micro_batch_size=self.limit
                )
        except (EstimateUnavailableError, PeerObjectError) as exc:  # the warm-up raises it
            self.notes.append(f"estimate unavailable ({exc}); used doubling-then-bisect")
            return None, None
        self.estimated_static_bytes = sum(t.untyped_storage().nbytes() for t in fake.resident())
        lo, _ = bracket(points)
        prior = fit_wide_line(points)
        self.notes.append(
            f"estimate: micro-batch {lo} fits in {format_bytes(capacity.capacity_bytes)} "
            f"({fake.num_steps} fake steps)"
        )
        del fake
        return prior, max(lo, 1)

    def _compare_with_estimate(self) -> None:
        """One note setting the estimated peak beside the measured one at each confirmed size."""
        compared = [t for t in self.trials if t.estimate_error is not None]
        if compared:
            self.notes.append(
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
        line = fit_memory_model(self.points, prior)
        skipped = sorted({t.micro_batch_size for t in self.trials if t.skipped_optimizer_step})
        if skipped:
            self.notes.append(
                f"train_step did not step the optimizer in the trials at micro-batch "
                f"{', '.join(map(str, skipped))} (it accumulates by itself): their peaks lack "
                "the update's temporaries; the optimizer state was present"
            )
        return Profile(
            max_micro_batch_size=largest,
            recommended_micro_batch_size=recommended_size(
                self.points,
                capacity_bytes=capacity.capacity_bytes,
                safety_margin=self.safety_margin,
                model=line,
            ),
            safety_margin=self.safety_margin,
            method="probe" if self.estimated or prior is not None else "doubling",
            trials=tuple(self.trials),
            num_steps=self.num_steps,
            device_name=self.device.name,
            device_type=self.device.type,
            total_memory_bytes=capacity.total_memory_bytes,
            capacity_bytes=capacity.capacity_bytes,
            foreign_memory_bytes=capacity.foreign_memory_bytes,
            memory_model=line,
            stop_kind=stop_kind,
            stop_reason=stop_reason,
            notes=tuple(self.notes),
            driver_version=self.device.driver_version,
            identity=self.identity,
            failed_micro_batch_size=self.failed_micro_batch_size,
            mode="eval" if self.evaluating else "train",
            compiled=self.compiled,
            created_at=now_iso(),
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
