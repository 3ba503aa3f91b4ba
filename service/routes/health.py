"""``/healthz`` (alive), ``/readyz`` (store writable, NVML state), ``/metrics`` (Prometheus).

These stay open when an API token is set, for kubelet probes and scrapers.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from autobatch.errors import DeviceUnavailableError, StoreError
from service.deps import StateDep
from service.metrics import CONTENT_TYPE
from service.schemas import HealthPublic, ReadyPublic

router = APIRouter(prefix="", tags=["health"])


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
def readyz(state: StateDep) -> JSONResponse:
    store, list_gpus, settings = state.store, state.list_gpus, state.settings
    store_detail = None
    try:
        store.check_writable()
    except StoreError as exc:
        store_detail = str(exc)
    nvml_detail = None
    num_gpus = 0
    try:
        num_gpus = len(list_gpus())
    except DeviceUnavailableError as exc:
        nvml_detail = str(exc)
    ready = store_detail is None and (not settings.require_gpu or num_gpus > 0)
    body = ReadyPublic(
        ready=ready,
        store_writable=store_detail is None,
        store_detail=store_detail,
        nvml_available=nvml_detail is None,
        num_gpus=num_gpus,
        nvml_detail=nvml_detail,
        require_gpu=settings.require_gpu,
    )
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(state.list_gpus), media_type=CONTENT_TYPE)
