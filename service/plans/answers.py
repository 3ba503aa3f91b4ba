"""The answer to a ``POST /v1/plan``, as JSON bytes: one function per question the body asks.

A job of cards (``job``) gets a micro-batch per rank from each card's profile
(:func:`job_plan_answer`); any other body a plan, its configs and (with ``world_sizes``) a table
(:func:`plan_answer`), planned within a limit from exactly one of a stored profile
(``profile_id``), the stored profile of a model drawn among the nodes (``model_fingerprint``,
with ``card`` or ``node`` or alone), a plain ``max_micro_batch_size`` or a ``memory_model``, for
the device the body names (:mod:`service.plans.devices`).

Store reads run on the store's threads with a deadline (``service.web.store_calls``); a plan
that may list many micro-batch sizes is planned and encoded in a worker thread.

Example::

    content = await plan_answer(body, state)   # bytes of a PlanPublic
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from anyio import CapacityLimiter, to_thread
from pydantic_core import to_json

from autobatch.device import MemoryBudget
from autobatch.planning import Plan, PlanSource, Selection
from autobatch.profile import MemoryModel, Profile
from service.deps import ServiceState
from service.plans.configs import plan_configs
from service.plans.devices import resolve_device
from service.plans.job import job_answer, select_job
from service.plans.limits import (
    check_answer_size,
    predicted_note,
    resolve_limit,
    select,
    selection_public,
)
from service.plans.planner import plan_and_table
from service.plans.schemas import PlanCreate
from service.web.problems import Problem
from service.web.schemas import ResolvedDevice
from service.web.store_calls import store_call
from service.web.wording import field_text, field_wording

__all__ = ["ON_LOOP_MICRO_BATCHES", "PlanLimit", "job_plan_answer", "plan_answer", "plan_limit"]

ON_LOOP_MICRO_BATCHES = 4096
"""An answer that may list more micro-batch sizes than this (one per accumulation step of its
plan and of each table row: at most the samples per rank) is planned and encoded off the event
loop: both grow with that list."""

_PLAN_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanLimit:
    """What a plan is planned within, and where it came from."""

    limit: int | Profile | MemoryModel
    """A plain max micro-batch size, a stored profile or a memory model."""
    profile_id: str | None
    source: PlanSource | None
    """The source to report; None for the planner's default."""
    selection: Selection | None = None
    """The choice among a model's profiles (a plan by ``model_fingerprint``)."""
    card_bytes: int | None = None
    """The card's memory in bytes when the profile was measured on another card."""


async def job_plan_answer(body: PlanCreate, state: ServiceState) -> bytes:
    """The answer for a job of cards: rank 0's plan and each card's (``ranks``).

    Raises:
        Problem: as :func:`service.plans.job.select_job` and
            :func:`service.plans.job.job_answer`.
        ConfigError, NoFeasiblePlanError: the planner's.
    """
    cards = await store_call(state, select_job, body, state.store, state.central)
    return to_json(job_answer(body, cards))


async def plan_answer(body: PlanCreate, state: ServiceState) -> bytes:
    """The plan, framework configs, and (with ``world_sizes``) a table over world sizes.

    Raises:
        Problem: 422 for a ``gpu_fraction`` without a device, and as
            :func:`~service.plans.devices.resolve_device`, :func:`plan_limit` and
            :func:`~service.plans.limits.check_answer_size`.
        ConfigError, NoFeasiblePlanError: the planner's, as for ``autobatch.plan``.
    """
    device = budget = None
    if body.device is not None:
        device, budget = await resolve_device(body.device, state.gpus, body.declared_fraction)
    elif body.gpu_fraction is not None:
        raise Problem(
            422,
            "validation",
            "gpu_fraction is a share of a device's memory: give the device (cuda_index, uuid, "
            "capacity_bytes or node_labels) it is a share of",
            field="body.gpu_fraction",
        )
    within = await plan_limit(body, state, device)
    capacity = within.card_bytes if device is None else device.capacity_bytes
    shown = None if device is None else device.model_dump()

    def answer() -> bytes:
        return _encoded(body, within, capacity, budget, shown)

    # at most this many micro-batch sizes listed (a micro-batch holds at least one sample)
    world_sizes = (body.world_size, *(body.world_sizes or ()))
    most = sum(body.effective_batch_size // world_size for world_size in world_sizes)
    if most <= ON_LOOP_MICRO_BATCHES:
        return answer()
    return await _off_the_loop(answer)


async def plan_limit(
    body: PlanCreate, state: ServiceState, device: ResolvedDevice | None
) -> PlanLimit:
    """The limit the body's plan is planned within: the profile of its model drawn among the
    nodes (for its ``card`` or ``node``, or the model alone), a stored profile by id, or the
    body's own number or memory model (no store read).

    Raises:
        Problem: as :func:`~service.plans.limits.select` and
            :func:`~service.plans.limits.resolve_limit`.
    """
    if body.model_fingerprint is not None:
        profile, profile_id, source, selection, card_bytes = await store_call(
            state, select, body, state.store, state.central, device
        )
        return PlanLimit(
            limit=profile,
            profile_id=profile_id,
            source=source,
            selection=selection,
            card_bytes=card_bytes,
        )
    limit: int | Profile | MemoryModel
    given_id: str | None
    given_source: PlanSource | None
    if body.profile_id is not None:
        limit, given_id, given_source = await store_call(
            state, resolve_limit, body, state.store, device
        )
    else:  # the body's own number or memory model: no store, no thread
        limit, given_id, given_source = resolve_limit(body, None, device)
    return PlanLimit(limit=limit, profile_id=given_id, source=given_source)


async def _off_the_loop(answer: Callable[[], bytes]) -> bytes:
    """``answer()`` in a worker thread, one long plan at a time: the planner holds the GIL
    while it runs, so one at a time keeps the event loop's share of it."""
    loop = asyncio.get_running_loop()
    limiter = _PLAN_LIMITERS.get(loop)
    if limiter is None:
        limiter = _PLAN_LIMITERS[loop] = CapacityLimiter(1)
    return await to_thread.run_sync(answer, limiter=limiter)


def _encoded(
    body: PlanCreate,
    within: PlanLimit,
    capacity_bytes: int | None,
    budget: MemoryBudget | None,
    device: dict[str, Any] | None,
) -> bytes:
    """The plan, its configs and table, encoded, with the profile id and ``device`` (the
    device already resolved, as the answer shows it).

    Raises:
        Problem: 422 when the answer would list more than ``MAX_ANSWER_MICRO_BATCHES``
            micro-batch sizes (``service.plans.limits.check_answer_size``).
        ConfigError, NoFeasiblePlanError: as for ``autobatch.plan``.
    """
    planned = plan_and_table(
        body,
        within.limit,
        capacity_bytes=capacity_bytes,
        budget=budget,
        source=within.source,
        check_plan=lambda result: check_answer_size(body, result),  # before any table
    )
    result = _in_fields(planned.plan)
    chosen = within.selection
    if chosen is not None and chosen.notes:
        result = dataclasses.replace(result, notes=(*result.notes, *chosen.notes))
    if chosen is not None and chosen.match == "predicted":
        result = dataclasses.replace(result, notes=(*result.notes, predicted_note(chosen, body)))
    options_table = None
    if planned.world_size_options is not None:
        options_table = [
            {
                "world_size": row.world_size,
                "plan": None if row.plan is None else _in_fields(row.plan),
                "reason": row.describe(field_wording),
            }
            for row in planned.world_size_options
        ]
    # PlanPublic's shape, serialized by pydantic-core in one call, Plans included: it writes a
    # dataclass as its fields, which is Plan.to_dict() (a test keeps the two equal). Building and
    # validating pydantic models of our own output only to dump them again would double the work
    # of the answer on the schedulers' hot path. Tests validate these responses against
    # PlanPublic, and the schema fuzz test checks every response against the OpenAPI.
    answer = {
        "plan": result,
        "configs": plan_configs(result),
        "world_size_options": options_table,
        "profile_id": within.profile_id,
        "device": device,
        "selection": None if chosen is None else selection_public(chosen, body),
        "ranks": None,
    }
    return to_json(answer)


def _in_fields(result: Plan) -> Plan:
    """``result`` with its notes in the service's words (:func:`service.web.wording.field_text`:
    arguments as JSON fields, library calls as routes)."""
    return dataclasses.replace(result, notes=tuple(map(field_text, result.notes)))
