"""``/healthz`` (alive), ``/readyz`` (store writable, NVML state), ``/metrics`` (Prometheus).

``/readyz`` checks the store in a worker thread with a deadline (``service.web.store_calls``): a
store locked by another process, or a database server that hangs, makes it answer "not ready" within
``store_timeout_seconds``, never a frozen event loop.

These stay open when an API token is set, for kubelet probes and scrapers. ``/healthz`` never
touches NVML; ``/readyz`` and ``/metrics`` read it through ``service.devices.gpus``, so a hung
driver costs them at most the NVML timeout once, then answers at once until the driver recovers.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from autobatch.errors import DeviceUnavailableError, StoreError
from service.deps import ServiceState, StateDep
from service.devices.gpus import HEALTH_FAILURES
from service.web.metrics import CONTENT_TYPE
from service.web.problems import RETRY_AFTER_SECONDS, Problem, store_reason
from service.web.store_calls import store_call
from service.web.wording import describe


class HealthPublic(BaseModel):
    status: Literal["ok"] = "ok"


class GpuProblem(BaseModel):
    uuid: str
    reason: str = Field(description="'nvml_timeout' or 'gpu_lost'.")
    detail: str


class ReadyPublic(BaseModel):
    ready: bool
    store_writable: bool
    store_detail: str | None
    nvml_available: bool
    num_gpus: int = Field(description="GPUs given to this container that answered.")
    nvml_reason: str | None = Field(description="A stable code when NVML is not usable.")
    nvml_detail: str | None
    gpu_problems: list[GpuProblem] = Field(
        description="Given GPUs that cannot be read now (a hung driver, a lost GPU); any makes "
        "the service not ready."
    )
    require_gpu: bool


router = APIRouter(prefix="", tags=["health"])
_log = logging.getLogger("service")


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> HealthPublic:
    """Checks nothing else: a failing store or GPU must not get the pod restarted."""
    return HealthPublic()


@router.get(
    "/readyz",
    summary="Readiness: the store is writable (and a GPU is present when required)",
    response_model=ReadyPublic,
    responses={503: {"model": ReadyPublic, "description": "Not ready"}},
)
async def readyz(state: StateDep) -> JSONResponse:
    """Not ready when the store is not writable, when a GPU given to this container cannot be
    read now (``nvml_timeout``, ``gpu_lost``), or with ``require_gpu`` when none answers."""
    body = await readiness(state)
    if body.ready:
        return JSONResponse(body.model_dump())
    return JSONResponse(
        body.model_dump(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


async def readiness(state: ServiceState) -> ReadyPublic:
    """The store's and the GPUs' state now: the store checked on its threads under its
    deadline, NVML read through the monitor (never on the event loop)."""
    store_detail = None
    try:
        await store_call(state, state.store.check_writable)
    except StoreError as exc:  # unauthenticated: in words, the location only in the log
        _log.warning("/readyz: %s", exc)
        store_detail = store_reason(exc)
    except Problem as exc:  # store-busy: the check did not answer in time
        store_detail = exc.detail
    nvml_reason = nvml_detail = None
    num_gpus = 0
    problems: list[GpuProblem] = []
    try:
        _inventory, readings = await state.gpus.snapshot()
    except DeviceUnavailableError as exc:
        nvml_reason, nvml_detail = exc.reason, describe(exc)
        if exc.reason in HEALTH_FAILURES:  # NVML itself hangs: not "no GPU here"
            problems.append(GpuProblem(uuid="", reason=exc.reason, detail=describe(exc)))
    else:
        for reading in readings:
            gpu = reading.gpu
            if not gpu.given:
                continue
            if gpu.memory_reason in HEALTH_FAILURES:
                problems.append(
                    GpuProblem(uuid=gpu.uuid, reason=gpu.memory_reason, detail=gpu.memory_detail)
                )
            elif gpu.cuda_index is not None:
                num_gpus += 1
    require_gpu = state.settings.require_gpu
    return ReadyPublic(
        ready=store_detail is None and not problems and (not require_gpu or num_gpus > 0),
        store_writable=store_detail is None,
        store_detail=store_detail,
        nvml_available=nvml_reason is None,
        num_gpus=num_gpus,
        nvml_reason=nvml_reason,
        nvml_detail=nvml_detail,
        gpu_problems=problems,
        require_gpu=require_gpu,
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(state: StateDep) -> Response:
    try:
        _inventory, readings = await state.gpus.snapshot()
        gpus = [reading.gpu for reading in readings]
    except DeviceUnavailableError:
        gpus = []
    return Response(state.metrics.render(lambda: gpus), media_type=CONTENT_TYPE)
