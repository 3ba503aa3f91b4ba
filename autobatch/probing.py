"""The probe: the largest micro-batch whose whole training step fits, in few real trials.

1. **Capacity** from the device (CUDA: NVML free + torch reserved, capped by the per-process
   fraction; simulated: its capacity less foreign bytes).
2. **Estimate** on fake tensors (:mod:`autobatch.estimator`): a predicted size and a memory line,
   with nothing allocated. When the step cannot run on fake tensors the probe says so in the
   profile's notes and falls back to doubling-then-bisect.
3. **Confirm and bisect** with real steps (:mod:`autobatch.search`): typically a warm-up at
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
5. **Leave no trace** (:mod:`autobatch.state`): parameters, buffers, gradients, optimizer state,
   train/eval flags and RNG states are restored bitwise.
6. **Ranks agree** through a :class:`Consensus` (one process: :class:`LocalConsensus`; under
   torch.distributed: :class:`autobatch.distributed.ProcessGroupConsensus`): every rank runs the
   same sizes in the same order, a size fits only if it fits on every rank (the capacity searched
   is the smallest rank's), a non-OOM failure on one rank is an upper bound for all of them, and
   a failure that ends the probe (at the first size) ends it on every rank.

Example::

    profile = autobatch.probe(model, (inputs, targets), loss_fn=F.cross_entropy, device="sim:2GiB")
    profile.max_micro_batch_size, profile.recommended_micro_batch_size, profile.num_trials
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from autobatch.batch import BatchSource
from autobatch.compiled import CompiledMode, compiled_mode, eager, mark_batch_dynamic
from autobatch.device import Capacity, Device, PeakMemory, resolve_device
from autobatch.device.oom import is_oom
from autobatch.distributed import FSDP2_LAYOUT, collective_layout
from autobatch.errors import (
    ConfigError,
    DistributedError,
    DoesNotFitError,
    Remedy,
    StepFailedError,
)
from autobatch.estimator import (
    DEFAULT_LIMIT,
    EstimateUnavailableError,
    FakeStep,
    check_search_arguments,
    estimate_points,
)
from autobatch.fake_collectives import reset_fsdp2
from autobatch.layouts import device_for_layout, trial_context
from autobatch.metadata import now_iso, step_identity
from autobatch.profile import MemoryModel, Profile, StopKind, Trial
from autobatch.search import (
    Point,
    bracket,
    fit_memory_model,
    fit_wide_line,
    next_micro_batch_size,
    recommended_size,
)
from autobatch.state import Snapshot, resident_tensors
from autobatch.step import (
    LossFn,
    OptimizerSteps,
    TrainingStep,
    TrainStep,
    check_step_arguments,
)
from autobatch.units import format_bytes
from autobatch.worst_case import WorstCaseSample

__all__ = [
    "MAX_WARM_UP_CALLS",
    "UNRELIABLE_ESTIMATE",
    "Consensus",
    "LocalConsensus",
    "confirm_micro_batch_size",
    "probe",
]

T = TypeVar("T")

MAX_WARM_UP_CALLS = 64
"""Calls the warm-up makes to a ``train_step`` that updates by itself (``step_includes_update``)
until it steps the optimizer (one that accumulates gradients over several calls); a step that
never does within this many calls is refused, as its optimizer state would never appear."""

OnTrial = Callable[[Trial], None]

UNRELIABLE_ESTIMATE = 0.25
"""Relative error of the estimated peak (against the measured one) above which the estimate is
called unreliable for this step, and the search goes on from measurements alone."""


class Consensus(Protocol):
    """How the ranks of a data-parallel job agree during a probe.

    Every rank makes the same calls in the same order, with sequences of the same length.
    """

    @property
    def rank(self) -> int:
        """This process's rank, in ``[0, world_size)``."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over the ranks, on every rank."""
        ...

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank."""
        ...


class LocalConsensus:
    """The consensus of a single process: every value is already agreed."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def min_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)


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
            :mod:`autobatch.step`.
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
            :class:`autobatch.distributed.ProcessGroupConsensus`.
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
    target = resolve_device(device, default=_model_device(model))
    source = BatchSource.from_sample(sample)
    check_placement(model, source, target)
    layout = collective_layout(model)
    if layout:
        target = device_for_layout(
            target, layout, world_size=None if consensus is None else consensus.world_size
        )
    snapshot = Snapshot.take(model, optimizer)
    run_optimizer = optimizer if optimizer is not None else _default_optimizer(model)
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
        snapshot.restore()
        del snapshot
        target.release()


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
    """One trial's outcome as every rank sees it (see ``_Probe._agree_outcome``)."""

    outcome: Outcome
    rank: int
    """Lowest rank with that outcome."""
    peak_bytes: int
    """Largest rank's peak when every rank measured one, else 0."""
    fatal_rank: int | None
    """Lowest rank whose error ends the probe, None when none."""


class _Probe:
    """One probe's state; :meth:`run` does the search. Not public: use :func:`probe`."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        user_optimizer: torch.optim.Optimizer | None,
        source: BatchSource,
        device: Device,
        loss_fn: LossFn | None,
        train_step: TrainStep | None,
        step_includes_update: bool,
        amp_dtype: torch.dtype | None,
        safety_margin: float,
        limit: int,
        use_estimate: bool,
        on_trial: OnTrial | None,
        consensus: Consensus,
        layout: str = "",
        evaluating: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.user_optimizer = user_optimizer
        self.source = source
        self.device = device
        self.loss_fn = loss_fn
        self.train_step = train_step
        self.step_includes_update = step_includes_update
        self.amp_dtype = amp_dtype
        self.safety_margin = safety_margin
        self.limit = limit
        self.use_estimate = use_estimate
        self.on_trial = on_trial
        self.consensus = consensus
        self.layout = layout
        self.evaluating = evaluating
        scaler = None
        if amp_dtype == torch.float16:
            scaler = torch.amp.GradScaler(device.torch_device.type)
        self.step = TrainingStep(
            model,
            optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            amp_dtype=amp_dtype,
            grad_scaler=scaler,
            step_on_overflow=True,
        )
        self.compiled: CompiledMode = compiled_mode(model, device.type)
        self.points: list[Point] = []
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.num_steps = 0
        self.estimated_static_bytes = 0
        self.failed_micro_batch_size = 0
        """Smallest size that failed for a reason other than memory (0: none did)."""
        self.prior: MemoryModel | None = None
        """The estimate's memory line; dropped when a measured peak shows it unreliable."""
        self.estimated = False
        """An estimate started the search (even if later found unreliable)."""

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

    def _run_step(self, batch: Any, *, train: bool) -> None:
        """A training step (model in train mode) or an evaluation step (model in eval mode)."""
        self.model.train(train)
        if train:
            self.step.run(batch)
        else:
            self.step.evaluate(batch)

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

    def _never_updated(self, size: int, calls: int) -> ConfigError:
        """The error for a warm-up whose ``train_step`` never stepped the optimizer."""
        name = type(self.optimizer).__name__
        return ConfigError(
            f"train_step ran {calls} times at micro-batch {size} and never called step() on the "
            f"optimizer passed as optimizer= ({name}), so its state (e.g. Adam's moments) never "
            "appeared and no measured step would include it. With step_includes_update=True "
            f"train_step must step that optimizer at least once every {MAX_WARM_UP_CALLS} calls: "
            "pass the optimizer it steps, accumulate over fewer calls while probing, or pass "
            "step_includes_update=False (the probe then adds backward, optimizer.step() and "
            "zero_grad() around a train_step that returns the loss)"
        )

    def _agree_capacity(self, own: Capacity) -> Capacity:
        """This device's capacity, lowered to the smallest rank's (the capacity searched)."""
        (packed,) = self.consensus.min_ints([self._with_rank(own.capacity_bytes)])
        smallest, rank = divmod(packed, self.consensus.world_size)
        if self.consensus.world_size > 1:
            self.notes.append(
                f"agreed over {self.consensus.world_size} ranks (a size fits only if it fits on "
                f"every rank): the smallest capacity is {format_bytes(smallest)}, on rank {rank}"
            )
        return dataclasses.replace(own, capacity_bytes=smallest)

    def _with_rank(self, value: int) -> int:
        """``value`` packed with this rank: the minimum over the ranks also names the (lowest)
        rank that holds it, by ``divmod(minimum, world_size)``."""
        return value * self.consensus.world_size + self.consensus.rank

    def _agree_size(self, size: int | None) -> int | None:
        """Rank 0's choice of the next size (None: the search is over), on every rank."""
        (agreed,) = self.consensus.broadcast_ints([0 if size is None else size])
        return agreed or None

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
        except EstimateUnavailableError as exc:
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

    def _warm_up(self) -> None:
        """One step at micro-batch 1 to create the optimizer state (Adam's moments); at 2 when 1
        cannot train (BatchNorm needs more than one value per channel). A compiled step measured
        as compiled also warms up at 2, where Dynamo compiles the graph for every size above 1,
        so that no measured step's time includes compilation."""
        try:
            self._trial(1, warm_up=True)
        except StepFailedError as exc:
            if not _needs_two_samples(exc.__cause__) or self.limit < 2:
                raise
            self.notes.append(
                "micro-batch 1 cannot train (BatchNorm needs more than one value per channel); "
                "warmed up at 2: keep every micro-batch at 2 or more"
            )
            self._trial(2, warm_up=True)
            return
        if self.compiled == "measured" and self.limit >= 2:
            self._trial(2, warm_up=True)

    def _confirm_compiled(self, size: int) -> None:
        """Run the compiled step once at ``size``, outside any dispatch mode (no memory counted).

        Raises:
            StepFailedError: the compiled step failed here (or DistributedError on the other
                ranks).
        """
        self.device.release()
        failure: StepFailedError | None = None
        try:
            self._run_step(self.source.make(size), train=not self.evaluating)
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
        self.num_steps += 1
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
        self.notes.append(
            f"torch.compile: trials ran the step eagerly (memory counted with a dispatch mode); "
            f"the compiled step ran at micro-batch {size}, its peak not measured"
        )

    def _trial(self, size: int, *, warm_up: bool = False, repeat: bool = False) -> None:
        """Run one real step at ``size``, agree on its outcome with the other ranks, record it.

        A warm-up runs a ``train_step`` that updates by itself again (up to
        :data:`MAX_WARM_UP_CALLS` calls) until it steps the optimizer. A ``repeat`` is the second
        step at a size that fitted: the size's point keeps the larger peak, or no longer fits.

        Raises:
            StepFailedError: a non-OOM failure before any size passed.
            ConfigError: the step is misconfigured, or a warm-up never stepped the optimizer.
            DistributedError: another rank raised one of those.
            DoesNotFitError: the warm-up did not fit.
        """
        self.device.release()
        peak: PeakMemory | None = None
        error = ""
        fatal: Exception | None = None  # raised once every rank knows
        updates = OptimizerSteps(self.optimizer)
        calls = MAX_WARM_UP_CALLS if warm_up and self.step_includes_update else 1
        train = warm_up or not self.evaluating
        calls_run = 0
        started = time.perf_counter()
        try:
            with self.device.measure(resident_tensors(self.model, self.optimizer)) as peak, updates:
                while calls_run == 0 or (calls_run < calls and not updates.count):
                    calls_run += 1
                    self._run_step(self._batch(size), train=train)
                self.device.synchronize()
            within = peak.reserved_bytes <= self.own_capacity.capacity_bytes
            outcome = Outcome.FITS if within else Outcome.OVER_CAPACITY
        except Exception as exc:  # classified right here; only a fatal one is kept
            oom = not isinstance(exc, ConfigError) and is_oom(exc)
            outcome = Outcome.OOM if oom else Outcome.FAILED
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if isinstance(exc, ConfigError):
                fatal = exc
            elif outcome is Outcome.FAILED and bracket(self.points)[0] == 0:
                fatal = StepFailedError(
                    f"the training step failed at micro-batch {size} for a reason other than "
                    f"memory: {error}{_hint(exc)}",
                    micro_batch_size=size,
                )
                fatal.__cause__ = exc
        seconds = time.perf_counter() - started
        self.num_steps += calls_run
        skipped_update = train and outcome.ran and not updates.count
        if skipped_update and warm_up:
            outcome = Outcome.FAILED
            error = f"no optimizer step in {calls_run} calls"
            fatal = self._never_updated(size, calls_run)
        if not outcome.ran:
            self._clean_up_after_failure()
        measured = peak.reserved_bytes if peak is not None and outcome.ran else 0
        if outcome is Outcome.OVER_CAPACITY:
            error = (
                f"peak {format_bytes(measured)} is over the capacity "
                f"{format_bytes(self.own_capacity.capacity_bytes)}"
            )
        agreed = self._agree_outcome(outcome, 0 if warm_up else measured, fatal is not None)
        if fatal is not None:
            raise fatal
        if agreed.fatal_rank is not None:
            raise DistributedError(
                f"rank {agreed.fatal_rank} failed at micro-batch {size} for a reason other than "
                "memory (its own error says why); every rank stopped probing"
            )
        if agreed.outcome is not outcome:  # another rank did worse
            error = (
                f"rank {agreed.rank} failed for a reason other than memory"
                if agreed.outcome is Outcome.FAILED
                else f"micro-batch {size} does not fit on every rank"
            )
        trial = Trial(
            micro_batch_size=size,
            fits=agreed.outcome is Outcome.FITS,
            oom=outcome is Outcome.OOM,
            peak_allocated_bytes=peak.allocated_bytes if peak is not None and outcome.ran else 0,
            peak_reserved_bytes=measured,
            step_seconds=seconds if outcome.ran else 0.0,
            error=error,
            warm_up=warm_up,
            skipped_optimizer_step=skipped_update,
            repeat=repeat,
            estimated_peak_bytes=(
                self.prior.peak_bytes(size)
                if self.prior is not None and outcome.ran and not warm_up
                else 0
            ),
        )
        self.trials.append(trial)
        peak_bytes = agreed.peak_bytes
        if repeat:  # the size's outcome is both steps'
            first_peaks = [p.peak_bytes for p in self.points if p.micro_batch_size == size]
            self.points = [p for p in self.points if p.micro_batch_size != size]
            if trial.fits:
                peak_bytes = max(peak_bytes, *first_peaks)
        self.points.append(
            Point(micro_batch_size=size, fits=trial.fits, peak_bytes=peak_bytes, warm_up=warm_up)
        )
        if self.on_trial is not None:
            self.on_trial(trial)
        if warm_up and not trial.fits:
            self._does_not_fit()
        if agreed.outcome is Outcome.FAILED and not 0 < self.failed_micro_batch_size < size:
            self.failed_micro_batch_size = size  # the smallest size that failed so
        self._check_estimate(trial)

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
        if error is None or abs(error) <= UNRELIABLE_ESTIMATE or self.prior is None:
            return
        self.prior = None
        self.notes.append(
            f"the estimate was unreliable for this step: at micro-batch {trial.micro_batch_size} "
            f"it predicted {format_bytes(trial.estimated_peak_bytes)}, the step measured "
            f"{format_bytes(trial.peak_allocated_bytes)} ({error:+.0%}); the search went on from "
            "measurements alone"
        )

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

    def _batch(self, size: int) -> Any:
        """The micro-batch of ``size``; its batch dimension dynamic for a step measured compiled,
        so that the sizes tried share one compiled graph."""
        batch = self.source.make(size)
        if self.compiled == "measured":
            mark_batch_dynamic(batch)
        return batch

    def _clean_up_after_failure(self) -> None:
        """Drop what the failed step left (gradients, a half-built optimizer state), collect
        garbage, then empty the allocator cache. An FSDP2 model gets its parameters resharded
        and its per-step state reset (the step stopped mid-forward or mid-backward)."""
        if self.layout == FSDP2_LAYOUT:
            reset_fsdp2(self.model)
        for param in self.model.parameters():
            param.grad = None
        if self.optimizer.state and len(self.optimizer.state) != _num_trainable(self.optimizer):
            self.optimizer.state.clear()
        self.device.release()

    def _does_not_fit(self) -> None:
        capacity = self.agreed_capacity
        grads = sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad
        )
        static = max(self.estimated_static_bytes + grads, _static_bytes(self.model, self.optimizer))
        ranks = self.consensus.world_size
        raise DoesNotFitError(
            f"the {'evaluation' if self.evaluating else 'training'} step does not fit on "
            f"{self.device.name}"
            f"{f' (or another of the {ranks} ranks)' if ranks > 1 else ''} even at micro-batch 1: "
            f"capacity {format_bytes(capacity.capacity_bytes)} "
            f"(total {format_bytes(capacity.total_memory_bytes)}, "
            f"{format_bytes(capacity.foreign_memory_bytes)} used by others); the model's static "
            f"footprint (weights, gradients, optimizer state) is about {format_bytes(static)}",
            remedies=(
                Remedy(purpose="a larger device"),
                Remedy(parameter="amp_dtype", values=("bfloat16",), purpose="reduced precision"),
                Remedy(purpose="a lighter optimizer"),
                Remedy(purpose="a smaller model"),
            ),
            device_name=self.device.name,
            capacity_bytes=capacity.capacity_bytes,
            required_bytes=static,
            static_bytes=static,
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
            identity=step_identity(
                self.model,
                self.source,
                self.user_optimizer,
                loss_fn=self.loss_fn,
                train_step=self.train_step,
                step_includes_update=self.step_includes_update,
                amp_dtype=self.amp_dtype,
            ),
            failed_micro_batch_size=self.failed_micro_batch_size,
            mode="eval" if self.evaluating else "train",
            compiled=self.compiled,
            created_at=now_iso(),
        )


def _needs_two_samples(exc: BaseException | None) -> bool:
    return exc is not None and "Expected more than 1 value per channel" in str(exc)


def _hint(exc: BaseException) -> str:
    """A fix for failures with a known cause, appended to the error message."""
    if "backward through the graph a second time" in str(exc):
        return (
            "; does your train_step call backward() itself? Then pass step_includes_update=True "
            "(and let it step and zero the optimizer too)"
        )
    return ""


def check_placement(model: torch.nn.Module, source: BatchSource, target: Device) -> None:
    """The model and the sample are on the device to probe (a probe never moves them).

    Raises:
        ConfigError: either is elsewhere (names both devices and the fix), or the model spans
            devices or has no tensors.
    """
    model_device = _model_device(model)
    if _normal(target.torch_device) != _normal(model_device):
        raise ConfigError(
            f"the model is on {model_device} but the device to probe is {target.name} "
            f"({target.torch_device}); move the model with model.to({str(target.torch_device)!r})"
        )
    if _normal(source.device) != _normal(model_device):
        raise ConfigError(
            f"the model is on {model_device} but the sample is on {source.device}; move the "
            f"sample with .to({str(model_device)!r})"
        )


def _model_device(model: torch.nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if not devices:
        raise ConfigError(
            f"model {type(model).__name__} has no parameters or buffers; there is nothing to "
            "train, so nothing to probe"
        )
    if len(devices) > 1:
        raise ConfigError(
            f"model {type(model).__name__} spans devices {sorted(map(str, devices))}; probe a "
            "model on one device (model-parallel models are not supported)"
        )
    return devices.pop()


def _normal(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(
            f"model {type(model).__name__} has no trainable parameter (requires_grad=True); "
            "there is no training step to probe"
        )
    return torch.optim.AdamW(params)


def _num_trainable(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(
        v.untyped_storage().nbytes()
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return weights + grads + state
