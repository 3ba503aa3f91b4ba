"""``POST /v1/plan``: micro-batch and accumulation steps for an effective batch on N devices.

The limit comes from exactly one of: a stored profile (``profile_id``), the newest stored profile
of a model (``model_fingerprint``), a plain ``max_micro_batch_size``, or a ``memory_model``. The
device, when given, is a local GPU (``cuda_index``/``uuid``, read from NVML), a capacity in bytes,
or Kubernetes GPU feature discovery labels (``nvidia.com/gpu.memory`` in MiB, a MIG slice's
``nvidia.com/mig-<profile>.memory`` with ``mig_profile``; see
:func:`autobatch.device.read_node_labels`).
``world_sizes`` adds a table over candidate world sizes (``planner.plan_world_sizes``). A
``job`` of cards and counts gets a micro-batch per rank from each card's profile
(:mod:`service.plans.job`).

A local GPU is one of the cards this container was given (``NVIDIA_VISIBLE_DEVICES``, then
``CUDA_VISIBLE_DEVICES``; ``cuda_index`` is CUDA's number in that set), read through
``service.devices.gpus``: off the event loop, 503 ``nvml_timeout``/``gpu_lost`` rather than a wait.

The device's memory is a budget (``autobatch.device.MemoryBudget``, on the plan as
``plan.budget``): the device's own memory (NVML's total or free, the labels' card, or the size
given), then device-plugin replicas (a time-sliced card is never planned whole), a vGPU limit
variable in this service's environment (``CUDA_DEVICE_MEMORY_LIMIT_<cuda_index>``), and a declared
``gpu_fraction``; the smallest decides. A job's CUDA runtime, where a sharing layer such as HAMi
limits its container, is out of the service's sight: the budget says so (``unseen_sources``,
and a warning). ``fits_now`` says whether the plan fits what is free now, and
``trials_per_gpu`` how many such jobs fit on one card.

Pure arithmetic after one store lookup (in a worker thread with a deadline,
``service.web.store_calls``) and one (cached) NVML reading at most: no torch is
imported on this path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

from anyio import CapacityLimiter, to_thread
from fastapi import APIRouter, Request, Response
from pydantic_core import to_json

from autobatch.device import (
    CardBudget,
    LabelError,
    MemoryBudget,
    budget_from_labels,
    budget_from_nvml,
)
from autobatch.errors import DeviceUnavailableError
from autobatch.planning import PlanRequest, PlanSource, Selection, given_budget, plan_with_table
from autobatch.profile import MemoryModel, Profile
from service.deps import service_state
from service.devices.gpus import GpuMonitor
from service.plans.configs import plan_configs
from service.plans.job import job_answer, select_job
from service.plans.limits import (
    check_answer_size,
    predicted_note,
    resolve_limit,
    select,
    selection_public,
)
from service.plans.schemas import PlanCreate, PlanPublic
from service.web.problems import Problem, problem_responses
from service.web.routing import JsonBodyRoute, json_body_openapi, read_json_body
from service.web.schemas import DeviceSpec, ResolvedDevice
from service.web.store_calls import store_call
from service.web.wording import field_wording

router = APIRouter(
    prefix="/v1/plan",
    route_class=JsonBodyRoute,
    tags=["plans"],
    responses=problem_responses(401),
)


@router.post(
    "",
    summary="Plan micro-batch and accumulation steps",
    response_model=PlanPublic,
    responses=problem_responses(400, 404, 413, 415, 422, 503),
    openapi_extra=json_body_openapi(PlanCreate),
)
async def create_plan(request: Request) -> Response:
    """The plan, framework configs, and (with ``world_sizes``) a table over world sizes.

    ``plan.source`` says where the limit came from: ``cached`` (a stored measured profile),
    ``estimated`` (a stored estimate), ``given`` (a number or memory model from the caller), or
    ``predicted`` (a stored profile planned past the largest size that really ran; ``prediction``
    says how far and from which line).
    """
    # Schedulers call this route in a loop: it reads its own body (a PlanCreate) and state
    # rather than through FastAPI's body parameter and a dependency (service.web.routing), and the
    # state only when it needs a GPU or the store.
    body = await read_json_body(request, PlanCreate)
    if body.job is not None:  # cards and counts: a micro-batch per rank (service.plans.job)
        state = service_state(request)
        cards = await store_call(state, select_job, body, state.store, state.central)
        return Response(to_json(job_answer(body, cards)), media_type="application/json")
    device = budget = None
    if body.device is not None:
        device, budget = await _resolve_device(
            body.device, service_state(request).gpus, body.declared_fraction
        )
    elif body.gpu_fraction is not None:
        raise Problem(
            422,
            "validation",
            "gpu_fraction is a share of a device's memory: give the device (cuda_index, uuid, "
            "capacity_bytes or node_labels) it is a share of",
            field="body.gpu_fraction",
        )
    capacity = None if device is None else device.capacity_bytes
    chosen: Selection | None = None
    limit: int | Profile | MemoryModel
    profile_id: str | None
    source: PlanSource | None
    if body.card is not None or body.node is not None:
        state = service_state(request)  # the store is read off the loop, with a deadline
        limit, profile_id, source, chosen, card_bytes = await store_call(
            state, select, body, state.store, state.central, device
        )
        if capacity is None:
            capacity = card_bytes
    elif body.profile_id is not None or body.model_fingerprint is not None:
        state = service_state(request)
        limit, profile_id, source = await store_call(
            state, resolve_limit, body, state.store, state.central, device
        )
    else:  # a number or a memory model from the caller: no store, no thread
        limit, profile_id, source = resolve_limit(body, None, None, device)
    plain = isinstance(limit, int)
    wanted = PlanRequest(
        effective_batch_size=body.effective_batch_size,
        world_size=body.data_parallel_ranks,
        world_sizes=None if body.world_sizes is None else tuple(body.world_sizes),
        multiple_of=body.multiple_of,
        max_gradient_accumulation_steps=body.max_gradient_accumulation_steps,
        uneven=body.uneven,
        allow_inexact=body.allow_inexact,
        safety_margin=None if plain else body.safety_margin,
        capacity_bytes=None if plain else capacity,
    )
    answer = functools.partial(
        _answer, body, limit, wanted, budget=budget, source=source, chosen=chosen
    )
    public = {"profile_id": profile_id, "device": None if device is None else device.model_dump()}
    # at most this many micro-batch sizes listed (a micro-batch holds at least one sample)
    world_sizes = (wanted.world_size, *(wanted.world_sizes or ()))
    most = sum(body.effective_batch_size // world_size for world_size in world_sizes)
    if most <= ON_LOOP_MICRO_BATCHES:
        return answer(public)
    return await _off_the_loop(answer, public)


ON_LOOP_MICRO_BATCHES = 4096
"""An answer that may list more micro-batch sizes than this (one per accumulation step of its
plan and of each table row: at most the samples per rank) is planned and encoded off the event
loop: both grow with that list."""

_PLAN_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


async def _off_the_loop(
    answer: Callable[[dict[str, Any]], Response], public: dict[str, Any]
) -> Response:
    """``answer(public)`` in a worker thread, one long plan at a time: the planner holds the GIL
    while it runs, so one at a time keeps the event loop's share of it."""
    loop = asyncio.get_running_loop()
    limiter = _PLAN_LIMITERS.get(loop)
    if limiter is None:
        limiter = _PLAN_LIMITERS[loop] = CapacityLimiter(1)
    return await to_thread.run_sync(answer, public, limiter=limiter)


def _answer(
    body: PlanCreate,
    limit: int | Profile | MemoryModel,
    wanted: PlanRequest,
    public: dict[str, Any],
    *,
    budget: MemoryBudget | None,
    source: PlanSource | None,
    chosen: Selection | None,
) -> Response:
    """The plan, its configs and table, encoded: ``public`` (the profile id and the device
    already resolved) with them.

    Raises:
        Problem: 422 when the answer would list more than ``MAX_ANSWER_MICRO_BATCHES``
            micro-batch sizes (``service.plans.limits.check_answer_size``).
        ConfigError, NoFeasiblePlanError: as for ``autobatch.plan``.
    """
    planned = plan_with_table(
        limit,
        wanted,
        budget=budget,
        source=source,
        check_table=lambda result: check_answer_size(body, result),
    )
    result = planned.plan
    if body.world_sizes is None:  # with a table, checked before the table was planned
        check_answer_size(body, result)
    if chosen is not None and chosen.match == "predicted":
        result = dataclasses.replace(result, notes=(*result.notes, predicted_note(chosen, body)))
    options_table = None
    if planned.world_size_options is not None:
        options_table = [
            {"world_size": row.world_size, "plan": row.plan, "reason": row.describe(field_wording)}
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
        "profile_id": public["profile_id"],
        "device": public["device"],
        "selection": None if chosen is None else selection_public(chosen, body),
        "ranks": None,
    }
    return Response(to_json(answer), media_type="application/json")


async def _resolve_device(
    spec: DeviceSpec, gpus: GpuMonitor, gpu_fraction: float | None
) -> tuple[ResolvedDevice, MemoryBudget]:
    """The device planned for and its memory budget (module docstring; built by
    ``autobatch.device``, read here); the device's ``capacity_bytes`` is the budget's.

    Raises:
        Problem: 422 for an unknown GPU, unreadable labels or no free memory; 503 when the
            GPU's memory (or its vGPU limit) is unknown.
    """
    if spec.capacity_bytes is not None:
        budget = given_budget(spec.capacity_bytes, gpu_fraction=gpu_fraction)
        return _resolved(CardBudget(budget=budget, source="capacity_bytes")), budget
    if spec.node_labels is not None:
        try:
            seen = [reading.gpu for reading in (await gpus.snapshot())[1]]
        except DeviceUnavailableError:
            seen = []  # a central instance, or no driver: the labels alone
        try:
            card = budget_from_labels(
                spec.node_labels, mig_profile=spec.mig_profile, gpu_fraction=gpu_fraction, gpus=seen
            )
        except LabelError as exc:
            field = (
                "body.gpu_fraction" if exc.field == "gpu_fraction" else f"body.device.{exc.field}"
            )
            raise Problem(422, "validation", str(exc), field=field) from None
        return _resolved(card), card.budget
    reading, inventory = await gpus.reading_for(cuda_index=spec.cuda_index, uuid=spec.uuid)
    if spec.cuda_index is not None:
        field, wanted = "body.device.cuda_index", f"cuda_index {spec.cuda_index}"
    else:
        field, wanted = "body.device.uuid", f"uuid {spec.uuid!r}"
    if reading is None:
        visible = ", ".join(
            f"{device.cuda_index}: {device.uuid}"
            for device in inventory.devices
            if device.cuda_index is not None
        )
        not_given = any(
            device.uuid == spec.uuid and not device.given for device in inventory.devices
        )
        why = " (NVML sees it, but this container was not given it)" if not_given else ""
        raise Problem(
            422,
            "unknown-device",
            f"this node has no GPU with {wanted}{why} (visible: {visible or 'none'})",
            field=field,
        )
    try:
        card = budget_from_nvml(
            reading.gpu, memory=spec.memory, gpu_fraction=gpu_fraction, environ=os.environ
        )
    except DeviceUnavailableError as exc:
        if exc.reason == "no_free_memory":
            raise Problem(422, "no-free-memory", str(exc), field="body.device.memory") from None
        raise Problem(503, "memory-unknown", str(exc), field=field) from None
    device = _resolved(
        card, sampled_at=reading.sampled_at, age_seconds=round(reading.age_seconds(), 3)
    )
    return device, card.budget


def _resolved(card: CardBudget, **reading: float) -> ResolvedDevice:
    """The device as the answer shows it: its capacity is the budget's, with the deciding
    source and the sharing mode beside it (and ``reading``'s time for a local GPU)."""
    budget = card.budget
    return ResolvedDevice(
        source=card.source,
        capacity_bytes=budget.budget_bytes,
        deciding_source=budget.deciding_source,
        sharing_mode=budget.sharing_mode,
        name=card.name,
        uuid=card.uuid,
        cuda_index=card.cuda_index,
        mig_profile=card.mig_profile,
        memory_source=card.memory_source,
        memory_held_by_others_bytes=card.memory_held_by_others_bytes,
        note=card.note,
        warnings=list(card.warnings),
        **reading,
    )
