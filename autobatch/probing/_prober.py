"""The probe: the largest micro-batch whose whole training step fits, in few real trials.

1. **Capacity** from the device (CUDA: NVML free + torch reserved, capped by the per-process
   fraction; simulated: its capacity less foreign bytes).
2. **Warm-up**: one real step at micro-batch 1 creates the optimizer state (so every measured step
   runs with it, as in training) and says what a real step costs here.
3. **Estimate** on fake tensors (:mod:`autobatch.probing._estimator`): a predicted size and a memory
   line, with nothing allocated, *when it pays*. The rule: the estimate may cost what it saves,
   the real steps the search runs without it before two measured peaks give it a line (its
   first two sizes, :func:`~autobatch.probing._search.growth_sizes`: the warm-up's line's max
   and one above, or the search from what ran's first two), priced from the
   warm-up's measured time: that time each where a step's time stays near it (a GPU's small
   steps, a simulated card's set cost), that time the size where it grows with the size (a CPU;
   :func:`~autobatch.probing._search.estimate_budget_seconds`). It does not start when
   :data:`EXPECTED_FAKE_STEPS` fake steps of the predicted length
   (:data:`FAKE_STEP_SECONDS_PER_TENSOR` per parameter tensor) would cost more, and it stops
   before a fake step that would take it past :data:`ESTIMATE_OVERRUN` times that (the mean of
   its steps so far as the next one's length); what it found by then still guides the search.
   On a CPU, where a real step is dear, it runs; on a GPU, where a real step takes milliseconds
   and a fake one the same CPU time as anywhere, the search goes on with real steps. Without a
   warm-up (the optimizer already has state) no real step was timed and the estimate runs.
   When the step cannot run on fake tensors the probe says so in the profile's notes and falls
   back to doubling-then-bisect.
4. **Confirm and bisect** with real steps (:mod:`autobatch.probing._search`): typically the
   predicted size, and one size above it. The search is safeguarded: whatever the
   peaks and the estimate say, it finds the exact max within ``ceil(log2(limit)) + 3`` trials
   besides the warm-up. Each measured peak is set beside the estimate's; an estimate off by more
   than :data:`UNRELIABLE_ESTIMATE` is said so in the notes and no longer steers the search.
5. **OOM** (classified by :func:`autobatch.device._oom.is_oom`) marks a size too big; after it, no
   reference to the failed step survives (gradients dropped, ``gc.collect()`` then the allocator
   cache emptied). Any other exception is not OOM: at the first trial it is re-raised as
   :class:`~autobatch.errors.StepFailedError`; later it is an upper bound (a kernel's launch
   limit, say): the search goes on below it, and the profile names the size and the error.
6. **Leave no trace** (:mod:`autobatch.probing._snapshot`): parameters, buffers, gradients,
optimizer state,
   train/eval flags and RNG states are restored bitwise.
7. **Ranks agree** through a :class:`Consensus` (one process: :class:`LocalConsensus`; under
   torch.distributed: :class:`autobatch.distributed._consensus.ProcessGroupConsensus`): every rank
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

from autobatch.device import Device, resolve_device
from autobatch.distributed import Consensus, reshard_fsdp2
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.probing._options import DEFAULT_SEARCH_LIMIT, OnTrial, ProbeOptions, StepSpec
from autobatch.probing._parallel import trial_context
from autobatch.probing._placement import model_device
from autobatch.probing._probe_run import (
    Prober,
    default_optimizer,
)
from autobatch.probing._snapshot import Snapshot, objects_frozen
from autobatch.probing._step import LossFn, TrainStep
from autobatch.probing._worst_case import WorstCaseSample
from autobatch.profile import (
    MemoryModel,
    Profile,
    Trial,
)

__all__ = ["probe", "run_confirmation", "run_probe"]

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
    gpu_fraction: float | None = None,
    amp_dtype: torch.dtype | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    max_micro_batch_size: int = DEFAULT_SEARCH_LIMIT,
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
            :mod:`autobatch.probing._step`.
        device: ``"cuda:N"``, ``"cpu"``, ``"sim:SIZE"`` or a :class:`~autobatch.device.Device`;
            None means the model's device. Its memory budget is the smallest of every source
            it can see (NVML, the CUDA runtime, vGPU limits, fractions, the cgroup; see
            :mod:`autobatch.device._budget`), recorded on the profile (``budget``).
        gpu_fraction: the share of a GPU this job is declared to get, in (0, 1] (Ray's
            ``num_gpus=0.5``: 0.5): the budget is at most that share of the card's memory. None
            for the whole card.
        amp_dtype: autocast dtype for forward and loss (float16 also scales the loss with a
            GradScaler), None for full precision.
        safety_margin: fraction of the capacity the recommended size keeps free, in [0, 1); the
            default 5% absorbs fragmentation and small input-shape changes.
        max_micro_batch_size: the search cap, the largest micro-batch tried (>= 1); not the
            measured maximum (the returned profile's ``max_micro_batch_size``).
        use_estimate: start from a fake-tensor estimate (False: doubling-then-bisect).
        on_trial: called after each real trial (progress display).
        consensus: how data-parallel ranks agree (every rank calls :func:`probe` with its own
            device); None for a single process. See
            :class:`autobatch.distributed._consensus.ProcessGroupConsensus`.
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
        search_limit=max_micro_batch_size,
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
        step, options: as the probe's; ``options.search_limit`` is ignored (the trial's
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


def run_timing(step: StepSpec, options: ProbeOptions, *, micro_batch_size: int) -> list[Trial]:
    """Three real, timed trials at ``micro_batch_size`` (after the warm-up step that creates
    the optimizer state; :data:`~autobatch.probing._probe_run.TIMED_STEPS`), leaving no trace,
    as :func:`probe` does: the time a plan's own micro-batch takes, where the probe's search
    never ran that size, and its spread (the measured noise).

    Returns:
        Every trial that ran (the warm-up too), the timed ones last, each with its
        ``step_seconds`` (0.0 where the step did not fit or was not timed); after a step that
        did not fit, no more run.

    Raises:
        ConfigError, StepFailedError, DeviceUnavailableError: as for :func:`probe`.
    """
    return _probing(
        step,
        dataclasses.replace(options.with_limit(micro_batch_size), use_estimate=False),
        lambda search: search.time_at(micro_batch_size),
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
            else default_optimizer(model, evaluating=options.eval)
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
