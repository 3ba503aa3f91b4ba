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
:class:`~autobatch.tuning.TuneRequest` (:meth:`~autobatch.tuning.TuneRequest.build`, their
options declared once in :class:`~autobatch.tuning.TuneOptions`) and call :func:`tune_request`
(checks that some plan is possible before it probes, then plans from the profile) or
:func:`tune_profile`; the request travels whole. The profile comes from
:func:`autobatch.tuning._lookup.find_profile`, the one place the store is read and written; the
plan from :mod:`autobatch.tuning._planned`, the one place the road calls the planner.

Example::

    plan = autobatch.autotune(model, sample, effective_batch_size=1024, device="sim:8GiB")
    plan.micro_batch_size, plan.gradient_accumulation_steps, plan.source
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Unpack

import torch
import torch.distributed as dist

from autobatch.device import MemoryBudget
from autobatch.distributed import LocalConsensus, process_group_consensus
from autobatch.errors import ConfigError
from autobatch.planning import Plan, RankLimit
from autobatch.probing import DEFAULT_SEARCH_LIMIT, ProbeOptions
from autobatch.profile import Profile
from autobatch.tuning._cache import TunedProfile
from autobatch.tuning._checkpointing import CheckpointingOutcome, tune_checkpointing
from autobatch.tuning._lookup import find_profile, why_probed_again
from autobatch.tuning._planned import (
    check_mixed_possible,
    check_possible,
    mixed_rank_plan,
    mixed_useful_cap,
    plan_from,
    rank_limit,
    useful_cap,
)
from autobatch.tuning._request import ProfileOptions, TuneOptions, TuneRequest, accept_options

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
    checkpointing: CheckpointingOutcome | None = None
    """What ``activation_checkpointing="auto"`` tried and chose (each mode's profile and plan,
    for the report); None for a fixed mode."""


logger = logging.getLogger("autobatch")


def autotune(
    model: torch.nn.Module,
    sample: Any,
    *,
    effective_batch_size: int | None = None,
    **options: Unpack[TuneOptions],
) -> Plan:
    """The micro-batch and accumulation steps that reach ``effective_batch_size`` on ``device``;
    without it, the largest micro-batch (Lightning's ``BatchSizeFinder`` question).

    Args:
        model: the model, on the device probed (a DDP or FSDP2 model: every rank probes).
        sample: one sample or a batch (a tensor, a tuple ``(inputs, targets)``, a dict), a
            callable ``n -> batch``, or a :func:`autobatch.worst_case_sample`; micro-batches
            are built along dim 0.
        effective_batch_size: samples per optimizer step over all ranks (> 0); None (the
            default) asks for the largest micro-batch instead: the plan is then one
            micro-batch per optimizer step, the profile's recommended size (the measured
            maximum less ``safety_margin``; rounded down to ``multiple_of``) on each of the
            ``world_size`` ranks, so ``effective_batch_size`` is that size x ``world_size``.
        **options: the step, the probe, the store and the plan's options, each documented
            once in :class:`~autobatch.tuning.TuneOptions` (``world_size``, ``device``,
            ``safety_margin``, ``max_micro_batch_size``, ``store``, ``eval``...); see
            :func:`autobatch.probe` for how a sample becomes a step.

    Returns:
        The Plan; ``source`` is ``"cached"`` when it came from the store, ``"measured"`` otherwise
        (a probe, or a prediction confirmed by a real trial here).
        ``micro_batch_size`` is at most the profile's recommended size. ``budget`` holds every
        memory source read, the deciding one, the sharing mode, ``fits_now`` and
        ``trials_per_gpu``; each disagreement over 5% is also a WARNING on the ``autobatch``
        logger.

    Raises:
        TypeError: a keyword :class:`~autobatch.tuning.TuneOptions` does not declare.
        ConfigError, DoesNotFitError, StepFailedError, DeviceUnavailableError: see
            :func:`autobatch.probe`.
        NoFeasiblePlanError: no split meets the constraints (names the nearest reachable sizes).
        StoreError: the store is corrupt, newer, or not writable.
        DistributedError: under torch.distributed, another rank failed (it raises the cause).
    """
    accept_options("autotune", options, TuneOptions)
    if effective_batch_size is None:
        return tune_largest(largest_request(model, sample, options)).plan
    request = TuneRequest.build(model, sample, effective_batch_size=effective_batch_size, **options)
    return tune_request(request).plan


def largest_request(model: torch.nn.Module, sample: Any, options: Any) -> TuneRequest:
    """The request of the largest micro-batch: its plan part's effective batch is a placeholder
    (the search cap on every data-parallel rank, so the batch caps no trial) that
    :func:`tune_largest` replaces with the largest micro-batch found on each rank.

    Raises:
        As :func:`autotune`.
    """
    cap = options.get("max_micro_batch_size") or DEFAULT_SEARCH_LIMIT
    request = TuneRequest.build(model, sample, effective_batch_size=cap, **options)
    assert request.plan is not None  # built with an effective batch
    # The world size is the request's (resolved once, by the build): the cap on every rank.
    placeholder = cap * request.plan.world_size
    planned = dataclasses.replace(request.plan, effective_batch_size=placeholder)
    return dataclasses.replace(request, plan=planned)


def tune_largest(request: TuneRequest) -> Tuning:
    """:func:`tune_request` for the largest micro-batch (:func:`largest_request`): the profile
    under the activation checkpointing asked, then one micro-batch per optimizer step at its
    recommended size (down to ``multiple_of``), and the evaluation micro-batch when asked.

    Raises:
        As :func:`autotune`.
    """
    wanted = request.plan
    assert wanted is not None  # largest_request's placeholder

    def planned(found: TunedProfile) -> Plan:
        step = wanted.multiple_of
        largest = max(step, found.profile.recommended_micro_batch_size // step * step)
        one_step = dataclasses.replace(
            wanted,
            effective_batch_size=largest * wanted.world_size,
            max_gradient_accumulation_steps=1,
        )
        budget = _plan_budget(request.probe, found.profile)
        return plan_from(found.profile, one_step, budget=budget, cached=found.cached)

    found, result, outcome = tune_checkpointing(request, request.probe, planned)
    return _finished(request, request.probe, found, result, outcome)


def tune(
    model: torch.nn.Module,
    sample: Any,
    *,
    effective_batch_size: int,
    **options: Unpack[TuneOptions],
) -> Tuning:
    """:func:`autotune`, returning the profile (and its id in the store) beside the plan.

    Arguments and errors as for :func:`autotune`.
    """
    accept_options("tune", options, TuneOptions)
    request = TuneRequest.build(model, sample, effective_batch_size=effective_batch_size, **options)
    return tune_request(request)


def tune_request(request: TuneRequest) -> Tuning:
    """The road for one :class:`~autobatch.tuning.TuneRequest` with a plan part: check that
    some plan is possible before probing, find the profile (:func:`find_profile`), plan from it
    with this device's memory budget, and probe the evaluation micro-batch when asked.
    :func:`autotune`, :func:`tune`, the CLI's ``tune`` and the drop-ins call this.

    Raises:
        ConfigError: the request has no ``effective_batch_size``; otherwise as :func:`autotune`.
        DoesNotFitError, StepFailedError, DeviceUnavailableError, NoFeasiblePlanError,
            StoreError, DistributedError: as :func:`autotune`.
    """
    wanted = request.plan
    if wanted is None:
        raise ConfigError(
            "tune_request plans, so its request needs effective_batch_size; for the profile "
            "alone call tune_profile"
        )
    if request.mixed_ranks:
        return _tune_mixed(request)
    check_possible(request.probe.search_limit, wanted)
    options = dataclasses.replace(
        request.probe, search_limit=useful_cap(request.probe.search_limit, wanted)
    )

    def planned(found: TunedProfile) -> Plan:
        budget = _plan_budget(options, found.profile)
        return plan_from(found.profile, wanted, budget=budget, cached=found.cached)

    found, result, outcome = tune_checkpointing(request, options, planned)
    if result.budget is not None:
        for warning in result.budget.warnings:
            logger.warning("memory budget %s: %s", result.budget.describe(), warning)
    return _finished(request, options, found, result, outcome)


def _finished(
    request: TuneRequest,
    options: ProbeOptions,
    found: TunedProfile,
    result: Plan,
    outcome: CheckpointingOutcome | None,
) -> Tuning:
    """The tuning of ``result`` planned from ``found``: its notes (the probe's, what
    ``"auto"`` tried), and with ``request.eval`` the evaluation micro-batch, found or probed.

    Raises:
        As :func:`autotune`.
    """
    result = _with_notes(result, found, options)
    if outcome is not None:
        result = dataclasses.replace(result, notes=(*result.notes, *outcome.notes()))
    if not request.eval:
        return Tuning(
            plan=result, profile=found.profile, profile_id=found.profile_id, checkpointing=outcome
        )
    evaluation = find_profile(request.step, options.for_eval(request.step), request.store).profile
    result = dataclasses.replace(
        result, eval_micro_batch_size=evaluation.recommended_micro_batch_size
    )
    return Tuning(
        plan=result,
        profile=found.profile,
        profile_id=found.profile_id,
        eval_profile=evaluation,
        checkpointing=outcome,
    )


def _tune_mixed(request: TuneRequest) -> Tuning:
    """:func:`tune_request` with ``mixed_ranks``: this rank probes its own device alone (its own
    profile, through the store as one process would), the ranks share each one's limit and
    step line, every rank computes the same mixed plan and returns its own rank's, completed
    with its own limit, memory budget and notes.

    Raises:
        ConfigError: more than one data-parallel rank without torch.distributed (no ranks to
            share limits with), or data-parallel ranks that are not the default group's;
            otherwise as :func:`autotune`.
        DistributedError: another rank failed while probing its own card (it raises why).
    """
    wanted = request.plan
    assert wanted is not None  # tune_request's check
    world_size = wanted.world_size
    distributed = dist.is_available() and dist.is_initialized()
    group_world_size = dist.get_world_size() if distributed else 1
    if world_size != group_world_size:
        why = "" if distributed else ": torch.distributed is not initialised"
        raise ConfigError(
            f"mixed_ranks=True plans one micro-batch per rank of the default process group "
            f"({group_world_size} rank(s){why}), but the plan is for {world_size} data-parallel "
            f"rank(s) ({request.probe.conditions.world_size_source}); call "
            "autotune on every rank after init_process_group, with no other world_size, or plan "
            "from known per-rank maxima with autobatch.planning.plan_mixed_ranks"
        )
    if request.checkpointing.mode != "none":
        raise ConfigError(
            f"activation_checkpointing={request.checkpointing.mode!r} is not planned with "
            "mixed_ranks=True yet; give activation_checkpointing='none' (apply a mode yourself "
            "before autotune to plan under it)"
        )
    check_mixed_possible(request.probe.search_limit, wanted)
    options = dataclasses.replace(
        request.probe,
        search_limit=mixed_useful_cap(request.probe.search_limit, wanted),
    )
    own: list[tuple[TunedProfile, RankLimit]] = []

    def probe_own() -> Any:
        found = find_profile(request.step, options, request.store)
        limit = rank_limit(found.profile, wanted, cached=found.cached)
        own.append((found, limit))
        return limit.shared()

    gathered = process_group_consensus(options.device.torch_device) or LocalConsensus()
    shared = gathered.on_every_rank(probe_own, "probing its own card for a mixed plan")
    found, limit = own[0]
    result = mixed_rank_plan(
        shared,
        wanted,
        rank=gathered.rank,
        limit=limit,
        budget=_plan_budget(options, found.profile),
    )
    result = _with_notes(result, found, options)
    return Tuning(plan=result, profile=found.profile, profile_id=found.profile_id)


def _with_notes(result: Plan, found: TunedProfile, options: ProbeOptions) -> Plan:
    """``result`` with the road's notes (why it probed again, the ranks, the conditions not in
    effect) and the profile's conditions with the plan's data-parallel size and its source
    (the request's, in ``options.conditions``)."""
    distributed = dist.is_available() and dist.is_initialized()
    world_size = result.world_size
    world_source = options.conditions.world_size_source
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
            world_size=world_size,
            world_size_source=world_source,
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
    model: torch.nn.Module, sample: Any, **options: Unpack[ProfileOptions]
) -> TunedProfile:
    """The profile :func:`autotune` plans from: a stored one that answers this request, else a
    new probe (stored unless a non-OOM failure cut it short).

    Args:
        model, sample: as for :func:`autotune`.
        **options: the step, the probe and the store's options, each documented once in
            :class:`~autobatch.tuning.ProfileOptions` (``eval=True`` finds or probes the
            evaluation profile). Under torch.distributed, every rank gets rank 0's profile.

    Raises:
        TypeError: a keyword :class:`~autobatch.tuning.ProfileOptions` does not declare.
        As :func:`autotune`, except NoFeasiblePlanError.
    """
    accept_options("autotune_profile", options, ProfileOptions)
    return tune_profile(TuneRequest.build(model, sample, **options))


def tune_profile(request: TuneRequest) -> TunedProfile:
    """The profile for one :class:`~autobatch.tuning.TuneRequest` (its plan part, if any, is
    not used): a stored one that answers, else a prediction confirmed here, else a probe.
    :func:`autotune_profile` and the service's probe jobs call this.

    Raises:
        As :func:`autotune_profile`.
    """
    return find_profile(request.step, request.probe, request.store)
