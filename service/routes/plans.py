"""``POST /v1/plan``: micro-batch and accumulation steps for an effective batch on N devices.

The limit comes from exactly one of: a stored profile (``profile_id``), the newest stored profile
of a model (``model_fingerprint``), a plain ``max_micro_batch_size``, or a ``memory_model``. The
device, when given, is a local GPU (``cuda_index``/``uuid``, read from NVML), a capacity in bytes,
or Kubernetes GPU feature discovery labels (``nvidia.com/gpu.memory`` in MiB, a MIG slice's
``nvidia.com/mig-<profile>.memory`` with ``mig_profile``; see
:func:`autobatch.device.read_node_labels`).
``world_sizes`` adds a table over candidate world sizes (``planner.plan_world_sizes``).

A local GPU is one of the cards this container was given (``NVIDIA_VISIBLE_DEVICES``, then
``CUDA_VISIBLE_DEVICES``; ``cuda_index`` is CUDA's number in that set), read through
``service.gpus``: off the event loop, 503 ``nvml_timeout``/``gpu_lost`` rather than a wait.

The device's memory is a budget (``autobatch.device.MemoryBudget``, on the plan as
``plan.budget``): the device's own memory (NVML's total or free, the labels' card, or the size
given), then device-plugin replicas (a time-sliced card is never planned whole), a vGPU limit
variable in this service's environment (``CUDA_DEVICE_MEMORY_LIMIT_<cuda_index>``), and a declared
``gpu_fraction``; the smallest decides. A job's CUDA runtime, where a sharing layer such as HAMi
limits its container, is out of the service's sight: the budget says so (``unseen_sources``,
and a warning). ``fits_now`` says whether the plan fits what is free now, and
``trials_per_gpu`` how many such jobs fit on one card.

Pure arithmetic after one store lookup (in a worker thread with a deadline,
``service.store_calls``) and one (cached) NVML reading at most: no torch is
imported on this path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic_core import to_json

from autobatch.device import (
    CardBudget,
    LabelError,
    MemoryBudget,
    budget_from_labels,
    budget_from_nvml,
)
from autobatch.errors import ConfigError, DeviceUnavailableError, ProfileNotFoundError
from autobatch.integrations import deepspeed_config, hf_training_arguments, lightning_config
from autobatch.planning import (
    DEFAULT_SAFETY_MARGIN,
    MAX_GRADIENT_ACCUMULATION_STEPS,
    Plan,
    PlanSource,
    Selection,
    given_budget,
    plan,
    plan_world_sizes,
    select_profile,
    stored_profile_source,
    with_budget,
)
from autobatch.profile import MemoryModel, Profile
from service.deps import service_state
from service.gpus import GpuMonitor
from service.problems import Problem, problem_responses, unknown_profile
from service.routing import JsonBodyRoute, json_body_openapi, read_json_body
from service.schemas import (
    DeviceSpec,
    PlanCreate,
    PlanPublic,
    ResolvedDevice,
)
from service.store_calls import store_call
from service.wording import field_wording

MAX_ANSWER_MICRO_BATCHES = 4 * MAX_GRADIENT_ACCUMULATION_STEPS
"""Micro-batch sizes one answer may list over its plan and ``world_sizes`` table (4,194,304:
about 8 MB of JSON); a single plan may list up to MAX_GRADIENT_ACCUMULATION_STEPS."""

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
    # rather than through FastAPI's body parameter and a dependency (service.routing), and the
    # state only when it needs a GPU or the store.
    body = await read_json_body(request, PlanCreate)
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
            state, _select, body, request
        )
        if capacity is None:
            capacity = card_bytes
    elif body.profile_id is not None or body.model_fingerprint is not None:
        state = service_state(request)
        limit, profile_id, source = await store_call(state, _resolve_limit, body, request, device)
    else:  # a number or a memory model from the caller: no store, no thread
        limit, profile_id, source = _resolve_limit(body, request, device)
    options: dict[str, Any] = {
        "multiple_of": body.multiple_of,
        "max_gradient_accumulation_steps": body.max_gradient_accumulation_steps,
        "uneven": body.uneven,
        "allow_inexact": body.allow_inexact,
    }
    if not isinstance(limit, int):
        options["capacity_bytes"] = capacity
        options["safety_margin"] = body.safety_margin
    result = plan(
        limit,
        effective_batch_size=body.effective_batch_size,
        world_size=body.data_parallel_ranks,
        source=source,
        **options,
    )
    margin = body.safety_margin
    if margin is None:
        margin = limit.safety_margin if isinstance(limit, Profile) else DEFAULT_SAFETY_MARGIN
    if budget is not None:
        result = with_budget(result, budget, safety_margin=margin)
    if chosen is not None and chosen.match == "predicted":
        result = dataclasses.replace(result, notes=(*result.notes, _predicted_note(chosen, body)))
    options_table = None
    if body.world_sizes is not None:
        _check_table_size(body, result)
        rows = plan_world_sizes(
            limit,
            effective_batch_size=body.effective_batch_size,
            world_sizes=body.world_sizes,
            source=source,
            **options,
        )
        options_table = [
            {
                "world_size": row.world_size,
                "plan": (
                    row.plan
                    if budget is None or row.plan is None
                    else with_budget(row.plan, budget, safety_margin=margin)
                ),
                "reason": row.describe(field_wording),
            }
            for row in rows
        ]
    # PlanPublic's shape, serialized by pydantic-core in one call, Plans included: it writes a
    # dataclass as its fields, which is Plan.to_dict() (a test keeps the two equal). Building and
    # validating pydantic models of our own output, then dumping them, cost about 40 µs more per
    # request (of ~250 µs in-process on 2 cores). Tests validate these responses against
    # PlanPublic, and the schema fuzz test checks every response against the OpenAPI.
    public = {
        "plan": result,
        "configs": _configs(result),
        "world_size_options": options_table,
        "profile_id": profile_id,
        "device": None if device is None else device.model_dump(),
        "selection": None if chosen is None else _selection_public(chosen, body),
    }
    return Response(to_json(public), media_type="application/json")


def _check_table_size(body: PlanCreate, result: Plan) -> None:
    """Refuse a ``world_sizes`` table whose plans would list more than
    :data:`MAX_ANSWER_MICRO_BATCHES` micro-batch sizes in all, before planning it.

    Each plan lists one size per accumulation step (up to 2**20 of them), so 32 world sizes with
    a micro-batch limit of 1 answered a 200-byte request with 69 MB in 1.9 s. The count is a
    lower bound: each row has at least ``ceil(E / (W * M))`` steps, ``M`` the plan's limit.

    Raises:
        Problem: 422, naming ``world_sizes`` and the fixes.
    """
    effective, limit = body.effective_batch_size, result.max_micro_batch_size
    least = result.gradient_accumulation_steps + sum(
        -(-effective // (world_size * limit))
        for world_size in body.world_sizes or ()
        if body.allow_inexact or effective % world_size == 0
    )
    if least > MAX_ANSWER_MICRO_BATCHES:
        raise Problem(
            422,
            "validation",
            f"the plan and world_sizes table would list at least {least} micro-batch sizes (one "
            f"per accumulation step of each plan; at most {MAX_ANSWER_MICRO_BATCHES} per "
            "answer): ask fewer world_sizes, or plan from a larger max_micro_batch_size",
            field="body.world_sizes",
        )


def _configs(result: Plan) -> dict[str, Any]:
    """``PlanConfigs``: the frameworks' settings, or nulls and the reason they cannot be given."""
    try:
        return {
            "deepspeed": deepspeed_config(result),
            "hf_training_arguments": hf_training_arguments(result),
            "lightning": lightning_config(result),
            "reason": None,
        }
    except ConfigError as exc:
        return {
            "deepspeed": None,
            "hf_training_arguments": None,
            "lightning": None,
            "reason": str(exc),
        }


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


def _resolve_limit(
    body: PlanCreate, request: Request, device: ResolvedDevice | None
) -> tuple[int | Profile | MemoryModel, str | None, PlanSource | None]:
    """(limit for the planner, profile id used, plan source to report or None for the
    planner's default); the profile store is ``request``'s service state's."""
    if body.max_micro_batch_size is not None:
        if device is not None or body.safety_margin is not None:
            raise Problem(
                422,
                "validation",
                "a plain max_micro_batch_size takes no device or safety_margin; to plan for a "
                "device's memory give a profile_id, model_fingerprint or memory_model",
                field="body.device" if device is not None else "body.safety_margin",
            )
        return body.max_micro_batch_size, None, None
    if body.memory_model is not None:
        if device is None:
            raise Problem(
                422, "validation", "a memory_model needs a device to plan for", field="body.device"
            )
        return MemoryModel(**body.memory_model.model_dump()), None, None
    if body.profile_id is not None:
        try:
            profile = service_state(request).store.get(body.profile_id)
        except ProfileNotFoundError:
            raise unknown_profile(body.profile_id, field="body.profile_id") from None
        return profile, body.profile_id, stored_profile_source(profile)
    assert body.model_fingerprint is not None
    store = service_state(request).store
    found = []
    if device is not None and device.name:
        found = store.list_profiles(
            model_fingerprint=body.model_fingerprint, device_name=device.name, limit=1
        )
    found = found or store.list_profiles(model_fingerprint=body.model_fingerprint, limit=1)
    if not found:
        found = _from_central(
            request, body.model_fingerprint, None if device is None else device.name
        )
    if not found:
        raise Problem(
            404,
            "unknown-profile",
            f"no stored profile has model_fingerprint {body.model_fingerprint!r} (the hash in a "
            "profile's model_fingerprint field, as GET /v1/profiles and a finished probe job "
            "show it; not a registry model name); register one with POST /v1/profiles or run "
            "a probe",
            field="body.model_fingerprint",
        )
    profile_id, profile = found[0]
    return profile, profile_id, stored_profile_source(profile)


CARD_CANDIDATES = (2, 8, 50)
"""Profiles of the model on the card asked about read per request (newest first) to find one
under the conditions asked, in growing pages: the newest 2 (one of them usually answers, and
decoding each profile costs about 70 µs on 2 cores), then 8, then 50; past them, the model's
newest :data:`ANY_CANDIDATES` of any card."""
ANY_CANDIDATES = 200


def _select(
    body: PlanCreate, request: Request
) -> tuple[Profile, str, PlanSource, Selection, int | None]:
    """A plan's profile for ``body.card``/``body.node`` (:mod:`autobatch.planning.selection`):
    (profile, its id, plan source, the selection, the card's memory in bytes when the plan is
    predicted for a card other than the profile's, else None).

    Raises:
        Problem: 404 when the store has no training profile of the model; 422 when the card's
            memory is unknown (no profile of any model measured on it, and no device given).
    """
    assert body.model_fingerprint is not None
    store = service_state(request).store
    wanted = body.conditions or {}
    try:
        chosen = None
        if body.card is not None and body.node is None:
            for limit in CARD_CANDIDATES:
                on_card = store.list_profiles(
                    model_fingerprint=body.model_fingerprint, device_name=body.card, limit=limit
                )
                chosen = select_profile(on_card, card=body.card, node=None, conditions=wanted)
                if len(on_card) < limit or (chosen is not None and chosen.match != "predicted"):
                    break
        if chosen is None or chosen.match == "predicted":
            candidates = store.list_profiles(
                model_fingerprint=body.model_fingerprint, limit=ANY_CANDIDATES
            )
            chosen = select_profile(candidates, card=body.card, node=body.node, conditions=wanted)
        if chosen is None:
            fetched = _from_central(request, body.model_fingerprint, body.card)
            chosen = select_profile(fetched, card=body.card, node=body.node, conditions=wanted)
    except ConfigError as exc:
        raise Problem(422, "validation", str(exc), field="body.conditions") from None
    if chosen is None:
        asked = " and ".join(
            f"{name} {value!r}"
            for name, value in (("card", body.card), ("node", body.node))
            if value is not None
        )
        raise Problem(
            404,
            "unknown-profile",
            f"no stored training profile has model_fingerprint {body.model_fingerprint!r}, so "
            f"nothing can plan it for {asked}, measured or predicted; publish one (POST "
            "/v1/profiles, autobatch tune --report-to URL, or a probe on a node whose sidecar "
            "reports here)",
            field="body.model_fingerprint",
        )
    profile = chosen.profile
    card_bytes = None
    if not chosen.same_card and body.card is not None and body.device is None:
        on_card = store.list_profiles(device_name=body.card, limit=1)
        if not on_card:
            raise Problem(
                422,
                "unknown-card",
                f"no stored profile (of any model) was measured on card {body.card!r}, so its "
                f"memory is unknown and the profile measured on {profile.device_name} cannot be "
                "scaled to it: give device.capacity_bytes (the card's memory in bytes), or "
                "check the card's name against GET /v1/profiles' device_name",
                field="body.card",
            )
        card_bytes = on_card[0][1].total_memory_bytes
    return profile, chosen.profile_id, stored_profile_source(profile), chosen, card_bytes


def _from_central(
    request: Request, model_fingerprint: str, card: str | None
) -> list[tuple[str, Profile]]:
    """Node mode, for a model this node's store does not hold: the central service's profile
    of it for ``card`` (:mod:`service.central`), kept in this node's store; empty without a
    central service, or when it holds none or does not answer."""
    state = service_state(request)
    if state.central is None:
        return []
    fetched = state.central.fetch(model_fingerprint, card=card)
    if fetched is None:
        return []
    _central_id, profile = fetched
    return [(state.store.put(profile), profile)]


def _predicted_note(chosen: Selection, body: PlanCreate) -> str:
    target = body.card or (f"node {body.node}" if body.node else "the card asked about")
    return (
        f"predicted for {target}, not measured there: planned from profile {chosen.profile_id} "
        f"({'; '.join(chosen.reasons)}); one real trial on that card confirms it"
    )


def _selection_public(chosen: Selection, body: PlanCreate) -> dict[str, Any]:
    profile = chosen.profile
    card = body.card
    if card is None and chosen.match != "predicted":
        card = profile.device_name
    return {
        "match": chosen.match,
        "profile_id": chosen.profile_id,
        "node_name": profile.node_name,
        "device_name": profile.device_name,
        "card": card,
        "reasons": list(chosen.reasons),
    }
