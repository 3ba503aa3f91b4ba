"""autotune: estimate -> probe -> plan, with the profile store as a cache.

A repeated call for the same model architecture, input shape, dtype/AMP, optimizer, device and
torch version is answered from the store without running a step (``refresh=True`` probes again).
When the store has no profile for this card but it (or the service at ``report_to``) has one of
the same step on another card, whose plan for this card would be ``predicted``, one real trial at
the predicted size confirms it instead of a probe; a failed confirmation probes and says so
(:mod:`autobatch.tuning._confirmation`; single process only: under torch.distributed the ranks
probe).

Under an initialised torch.distributed process group every rank probes its own device and the
ranks agree (:mod:`autobatch.distributed._layout`): a size fits only if it fits on every rank,
``world_size`` defaults to the group's, rank 0 alone reads and writes the store (its cached
profile is used only when every rank has the same device, i.e. the same cache key), and every
rank returns the same Plan.

The flat keyword functions (:func:`autotune`, :func:`tune`, :func:`autotune_profile`) build a
:class:`~autobatch.tuning.TuneRequest` and call :func:`tune_request` (checks that some plan is
possible before it probes, then plans from the profile) or :func:`tune_profile`; the profile
comes from :func:`autobatch.tuning._lookup.find_profile`, the one place the store is read and
written.

Example::

    plan = autobatch.autotune(model, sample, effective_batch_size=1024, device="sim:8GiB")
    plan.micro_batch_size, plan.gradient_accumulation_steps, plan.source
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autobatch.client import service_remote
from autobatch.device import Device, MemoryBudget, resolve_device
from autobatch.distributed import (
    LocalConsensus,
    process_group_consensus,
    resolve_data_parallel,
)
from autobatch.errors import ConfigError
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning import (
    Limit,
    Plan,
    PlanRequest,
    RankLimit,
    Uneven,
    budget_margin,
    budgeted_plan,
    largest_useful_micro_batch_size,
    mixed_plans,
    plan_request,
    resolve_plan_limit,
    stored_profile_source,
    with_budget,
    with_limit,
)
from autobatch.probing import (
    DEFAULT_LIMIT,
    LossFn,
    OnTrial,
    ProbeOptions,
    StepSpec,
    TrainStep,
    model_device,
)
from autobatch.profile import Profile
from autobatch.profiles import ProfileStore
from autobatch.tuning._cache import StoreOptions, TunedProfile
from autobatch.tuning._lookup import find_profile, why_probed_again
from autobatch.tuning._request import TuneRequest

__all__ = [
    "Tuning",
    "autotune",
    "autotune_profile",
    "tune",
    "tune_profile",
    "tune_request",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tuning:
    """What :func:`tune` found: the plan and the profile it was made from."""

    plan: Plan
    """``source`` is ``"cached"`` when the profile came from the store."""
    profile: Profile
    profile_id: str | None
    """As for :attr:`TunedProfile.profile_id`."""
    eval_profile: Profile | None = None
    """The evaluation probe's profile (``eval=True``), whose recommended size is the plan's
    ``eval_micro_batch_size``; None without ``eval``."""


logger = logging.getLogger("autobatch")


def autotune(
    model: torch.nn.Module,
    sample: Any,
    *,
    effective_batch_size: int,
    world_size: int | None = None,
    data_parallel_size: int | None = None,
    process_group: dist.ProcessGroup | DeviceMesh | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    device: str | Device | None = None,
    gpu_fraction: float | None = None,
    amp_dtype: torch.dtype | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    max_micro_batch_size: int = DEFAULT_LIMIT,
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    uneven: Uneven = "auto",
    allow_inexact: bool = False,
    mixed_ranks: bool = False,
    store: ProfileStore | str | os.PathLike[str] | None = None,
    use_store: bool = True,
    refresh: bool = False,
    report_to: str | None = None,
    on_trial: OnTrial | None = None,
    eval: bool = False,
) -> Plan:
    """The micro-batch and accumulation steps that reach ``effective_batch_size`` on ``device``.

    Args:
        model, sample, optimizer, loss_fn, train_step, step_includes_update, device,
            gpu_fraction, amp_dtype, safety_margin, max_micro_batch_size, on_trial: as for
            :func:`autobatch.probe`; no trial is larger than
            ``ceil(effective_batch_size / world_size)`` either, the largest micro-batch a plan
            for this request can use.
        effective_batch_size: samples per optimizer step over all ranks (> 0).
        world_size, data_parallel_size: data-parallel ranks (the same thing; give one). Default:
            the size of ``process_group`` when given, else the default process group's size
            under an initialised torch.distributed (refused when the model's parameters are on
            a DeviceMesh with tensor-parallel ranks: say which ranks are data-parallel), else 1.
            Under torch.distributed the plan's notes end with ``E = m x k x dp`` in words.
        process_group: the data-parallel ranks' process group, or that dimension of a
            DeviceMesh (``mesh["dp"]``); only its size is used. The ranks probing together are
            always the whole default group (a micro-batch must fit on every rank).
        multiple_of, max_gradient_accumulation_steps, uneven, allow_inexact: planner constraints,
            see :func:`autobatch.plan`.
        mixed_ranks: ranks on cards of different memory or speed: under torch.distributed each
            rank probes its own card alone, the ranks share their limits and step times, and
            each returns its own plan of one mixed plan
            (:func:`autobatch.planning.plan_mixed_ranks`): ``micro_batch_size`` its own,
            ``rank_micro_batch_sizes`` every rank's, one ``gradient_accumulation_steps``. Feed
            each rank its share of every global batch
            (:class:`autobatch.training.MixedBatchSampler`); the Accumulator weights the ranks'
            losses by the rows they trained. Not with ``allow_inexact``; ``world_size`` must be
            the default group's.
        store: a ProfileStore or a path; None means the default store
            (``$AUTOBATCH_STORE`` or ``~/.cache/autobatch/profiles.sqlite3``).
        use_store: False skips the store (no read, no write).
        refresh: probe again even when the store has a profile.
        report_to: base URL of an autobatch service; a newly probed profile is registered there
            (``POST /v1/profiles``, bearer token from ``AUTOBATCH_API_TOKEN``). Under
            torch.distributed only rank 0 reports. A failure to report warns
            (:class:`ReportWarning`) and does not raise.
        eval: also probe the evaluation micro-batch (:func:`autobatch.probe` with
            ``eval=True``, cached in the store apart from the training profile); the plan's
            ``eval_micro_batch_size`` is its recommended size.

    Returns:
        The Plan; ``source`` is ``"cached"`` when it came from the store, ``"measured"`` otherwise
        (a probe, or a prediction confirmed by a real trial here).
        ``micro_batch_size`` is at most the profile's recommended size. ``budget`` holds every
        memory source read, the deciding one, the sharing mode, ``fits_now`` and
        ``trials_per_gpu``; each disagreement over 5% is also a WARNING on the ``autobatch``
        logger.

    Raises:
        ConfigError, DoesNotFitError, StepFailedError, DeviceUnavailableError: see
            :func:`autobatch.probe`.
        NoFeasiblePlanError: no split meets the constraints (names the nearest reachable sizes).
        StoreError: the store is corrupt, newer, or not writable.
        DistributedError: under torch.distributed, another rank failed (it raises the cause).
    """
    return tune_request(
        TuneRequest(
            model=model,
            sample=sample,
            effective_batch_size=effective_batch_size,
            world_size=world_size,
            data_parallel_size=data_parallel_size,
            process_group=process_group,
            optimizer=optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            device=device,
            gpu_fraction=gpu_fraction,
            amp_dtype=amp_dtype,
            safety_margin=safety_margin,
            max_micro_batch_size=max_micro_batch_size,
            multiple_of=multiple_of,
            max_gradient_accumulation_steps=max_gradient_accumulation_steps,
            uneven=uneven,
            allow_inexact=allow_inexact,
            mixed_ranks=mixed_ranks,
            store=store,
            use_store=use_store,
            refresh=refresh,
            report_to=report_to,
            on_trial=on_trial,
            eval=eval,
        )
    ).plan


def tune(
    model: torch.nn.Module,
    sample: Any,
    *,
    effective_batch_size: int,
    world_size: int | None = None,
    data_parallel_size: int | None = None,
    process_group: dist.ProcessGroup | DeviceMesh | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    device: str | Device | None = None,
    gpu_fraction: float | None = None,
    amp_dtype: torch.dtype | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    max_micro_batch_size: int = DEFAULT_LIMIT,
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    uneven: Uneven = "auto",
    allow_inexact: bool = False,
    mixed_ranks: bool = False,
    store: ProfileStore | str | os.PathLike[str] | None = None,
    use_store: bool = True,
    refresh: bool = False,
    report_to: str | None = None,
    on_trial: OnTrial | None = None,
    eval: bool = False,
) -> Tuning:
    """:func:`autotune`, returning the profile (and its id in the store) beside the plan.

    Arguments and errors as for :func:`autotune`.
    """
    return tune_request(
        TuneRequest(
            model=model,
            sample=sample,
            effective_batch_size=effective_batch_size,
            world_size=world_size,
            data_parallel_size=data_parallel_size,
            process_group=process_group,
            optimizer=optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            device=device,
            gpu_fraction=gpu_fraction,
            amp_dtype=amp_dtype,
            safety_margin=safety_margin,
            max_micro_batch_size=max_micro_batch_size,
            multiple_of=multiple_of,
            max_gradient_accumulation_steps=max_gradient_accumulation_steps,
            uneven=uneven,
            allow_inexact=allow_inexact,
            mixed_ranks=mixed_ranks,
            store=store,
            use_store=use_store,
            refresh=refresh,
            report_to=report_to,
            on_trial=on_trial,
            eval=eval,
        )
    )


def tune_request(request: TuneRequest) -> Tuning:
    """The road for one :class:`~autobatch.tuning.TuneRequest` with an
    ``effective_batch_size``: resolve the ranks, check that some plan is possible before
    probing, find the profile (:func:`find_profile`), plan from it with this device's memory
    budget (:func:`autobatch.planning.budgeted_plan`), and probe the evaluation micro-batch
    when asked. :func:`autotune`, :func:`tune`, the CLI's ``tune`` and the drop-ins call this.

    Raises:
        ConfigError: the request has no ``effective_batch_size``; otherwise as :func:`autotune`.
        DoesNotFitError, StepFailedError, DeviceUnavailableError, NoFeasiblePlanError,
            StoreError, DistributedError: as :func:`autotune`.
    """
    if request.plan is None:
        raise ConfigError(
            "tune_request plans, so its request needs effective_batch_size; for the profile "
            "alone call tune_profile"
        )
    world_size, world_source = resolve_data_parallel(
        request.model,
        world_size=request.world_size,
        data_parallel_size=request.data_parallel_size,
        process_group=request.process_group,
    )
    wanted = dataclasses.replace(request.plan, world_size=world_size)
    if request.mixed_ranks:
        return _tune_mixed(request, wanted, (world_size, world_source))
    # Fail before probing when no micro-batch the probe could find makes a plan.
    plan_request(request.max_micro_batch_size, wanted)
    step, options = _bundles(
        request,
        # Sizes no plan for this request can use are not worth a trial (nor the estimate's).
        max_micro_batch_size=min(
            request.max_micro_batch_size,
            largest_useful_micro_batch_size(wanted.effective_batch_size, world_size),
        ),
        data_parallel=(world_size, world_source),
        eval=False,  # the training profile plans; the evaluation's is probed after it
    )
    storing = _storing(request)
    found = find_profile(step, options, storing)
    source = stored_profile_source(found.profile) if found.cached else None
    budget = _plan_budget(options, found.profile)
    result = budgeted_plan(found.profile, wanted, budget=budget, source=source)
    if result.budget is not None:
        for warning in result.budget.warnings:
            logger.warning("memory budget %s: %s", result.budget.describe(), warning)
    result = _with_notes(result, found, options, world_size, world_source)
    if not request.eval:
        return Tuning(plan=result, profile=found.profile, profile_id=found.profile_id)
    evaluation = find_profile(step, options.for_eval(step), storing).profile
    result = dataclasses.replace(
        result, eval_micro_batch_size=evaluation.recommended_micro_batch_size
    )
    return Tuning(
        plan=result, profile=found.profile, profile_id=found.profile_id, eval_profile=evaluation
    )


def _tune_mixed(
    request: TuneRequest, wanted: PlanRequest, data_parallel: tuple[int, str]
) -> Tuning:
    """:func:`tune_request` with ``mixed_ranks``: this rank probes its own device alone (its own
    profile, through the store as one process would), the ranks share each one's limit and
    step line (:class:`~autobatch.planning.RankLimit`), every rank computes the same mixed plan
    (:func:`~autobatch.planning.mixed_plans`) and returns its own rank's, completed with its
    own limit, memory budget and notes.

    Raises:
        ConfigError: more than one data-parallel rank without torch.distributed (no ranks to
            share limits with), or data-parallel ranks that are not the default group's;
            otherwise as :func:`autotune`.
        DistributedError: another rank failed while probing its own card (it raises why).
    """
    world_size, world_source = data_parallel
    distributed = dist.is_available() and dist.is_initialized()
    group_size = dist.get_world_size() if distributed else 1
    if world_size != group_size:
        why = "" if distributed else ": torch.distributed is not initialised"
        raise ConfigError(
            f"mixed_ranks=True plans one micro-batch per rank of the default process group "
            f"({group_size} rank(s){why}), but the plan is for {world_size} data-parallel "
            f"rank(s) ({world_source}); call "
            "autotune on every rank after init_process_group, with no other world_size, or plan "
            "from known per-rank maxima with autobatch.planning.plan_mixed_ranks"
        )
    # Fail before probing when no micro-batches the probes could find make a plan.
    mixed_plans([RankLimit(max_micro_batch_size=request.max_micro_batch_size)] * world_size, wanted)
    # The most one rank can take: the effective batch less the least the others take.
    useful = wanted.effective_batch_size - (world_size - 1) * wanted.multiple_of
    step, options = _bundles(
        request,
        max_micro_batch_size=max(1, min(request.max_micro_batch_size, useful)),
        data_parallel=data_parallel,
        eval=False,
        alone=True,
    )
    storing = _storing(request)
    own: list[tuple[TunedProfile, Limit]] = []

    def probe_own() -> RankLimit:
        found = find_profile(step, options, storing)
        source = stored_profile_source(found.profile) if found.cached else None
        own.append((found, resolve_plan_limit(found.profile, wanted, source)))
        return RankLimit.of(own[0][1])

    gathered = process_group_consensus(options.device.torch_device) or LocalConsensus()
    shared = gathered.on_every_rank(probe_own, "probing its own card for a mixed plan")
    found, limit = own[0]
    result = with_limit(mixed_plans(shared, wanted)[gathered.rank], limit, profile=found.profile)
    budget = _plan_budget(options, found.profile)
    if budget is not None:
        result = with_budget(result, budget, safety_margin=budget_margin(found.profile, wanted))
    result = _with_notes(result, found, options, world_size, world_source)
    return Tuning(plan=result, profile=found.profile, profile_id=found.profile_id)


def _with_notes(
    result: Plan, found: TunedProfile, options: ProbeOptions, world_size: int, world_source: str
) -> Plan:
    """``result`` with the road's notes (why it probed again, the ranks, the conditions not in
    effect) and the profile's conditions with the plan's data-parallel size and its source."""
    distributed = dist.is_available() and dist.is_initialized()
    notes = [*why_probed_again(found), *result.notes]
    if world_size == 1 and distributed:
        # One data-parallel rank among several processes (tensor or pipeline parallel): the
        # planner notes E = m x k x dp only for dp > 1, and here dp = 1 is worth saying.
        notes.append(result.formula())
    notes.extend(options.conditions.not_in_effect())
    if world_source.startswith("the launcher") and not distributed:
        notes.append(
            f"world_size {world_size} from {world_source}: torch.distributed is not initialised "
            "yet, so the ranks did not agree on the micro-batch (each probed its own device); "
            "call autotune after init_process_group for one plan on every rank"
        )
    return dataclasses.replace(
        result,
        notes=tuple(notes),
        conditions=dataclasses.replace(
            found.profile.conditions,
            data_parallel_size=world_size,
            data_parallel_source=world_source,
        ),
    )


def _plan_budget(options: ProbeOptions, profile: Profile) -> MemoryBudget | None:
    """The memory budget a plan states: this device's now for one process; under
    torch.distributed the profile's (rank 0's, with the smallest rank's capacity), so every rank
    returns the same plan."""
    if options.consensus.world_size > 1:
        return profile.budget
    return options.device.capacity().budget or profile.budget


def autotune_profile(
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
    store: ProfileStore | str | os.PathLike[str] | None = None,
    use_store: bool = True,
    refresh: bool = False,
    report_to: str | None = None,
    on_trial: OnTrial | None = None,
    eval: bool = False,
) -> TunedProfile:
    """The profile :func:`autotune` plans from: a stored one that answers this request, else a
    new probe (stored unless a non-OOM failure cut it short). The service's probe jobs call this.

    Arguments as for :func:`autotune`; ``use_estimate`` as for :func:`autobatch.probe`;
    ``eval=True`` finds (or probes) the evaluation profile (:func:`autobatch.probe`'s
    ``eval``). Under torch.distributed, every rank gets rank 0's profile (see :func:`autotune`).

    Raises:
        As :func:`autotune`, except NoFeasiblePlanError.
    """
    return tune_profile(
        TuneRequest(
            model=model,
            sample=sample,
            optimizer=optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            device=device,
            gpu_fraction=gpu_fraction,
            amp_dtype=amp_dtype,
            safety_margin=safety_margin,
            max_micro_batch_size=max_micro_batch_size,
            use_estimate=use_estimate,
            store=store,
            use_store=use_store,
            refresh=refresh,
            report_to=report_to,
            on_trial=on_trial,
            eval=eval,
        )
    )


def tune_profile(request: TuneRequest) -> TunedProfile:
    """The profile for one :class:`~autobatch.tuning.TuneRequest` (its plan part, if any, is
    not used): a stored one that answers, else a prediction confirmed here, else a probe.
    :func:`autotune_profile` and the service's probe jobs call this.

    Raises:
        As :func:`autotune_profile`.
    """
    step, options = _bundles(
        request, max_micro_batch_size=request.max_micro_batch_size, eval=request.eval
    )
    return find_profile(step, options, _storing(request))


def _storing(request: TuneRequest) -> StoreOptions:
    return StoreOptions(
        store=request.store,
        use_store=request.use_store,
        refresh=request.refresh,
        remote=service_remote(request.report_to),
    )


def _bundles(
    request: TuneRequest,
    *,
    max_micro_batch_size: int,
    eval: bool,
    data_parallel: tuple[int, str] | None = None,
    alone: bool = False,
) -> tuple[StepSpec, ProbeOptions]:
    """The step and the probe options of ``request`` (:meth:`StepSpec.build`,
    :meth:`ProbeOptions.build` with the live conditions), probing up to ``max_micro_batch_size``
    the training step or (``eval``) the evaluation;
    under torch.distributed the options agree through the default process group (every rank
    must call this), unless ``alone``: this rank probes its own device by itself (a mixed
    plan)."""
    model = request.model
    step = StepSpec.build(
        model,
        request.sample,
        optimizer=request.optimizer,
        loss_fn=request.loss_fn,
        train_step=request.train_step,
        step_includes_update=request.step_includes_update,
        amp_dtype=request.amp_dtype,
    )
    target = resolve_device(
        request.device, default=model_device(model), gpu_fraction=request.gpu_fraction
    )
    options = ProbeOptions.build(
        step,
        device=target,
        consensus=LocalConsensus() if alone else process_group_consensus(target.torch_device),
        safety_margin=request.safety_margin,
        max_micro_batch_size=max_micro_batch_size,
        use_estimate=request.use_estimate,
        on_trial=request.on_trial,
        eval=eval,
        data_parallel=data_parallel,
    )
    return step, options
