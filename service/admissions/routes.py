"""``POST /v1/admissions``: a scheduler's decision for a job before it starts (accept with a
plan, size its GPU count, refuse an unreachable batch), as one request any admission controller
or Slurm plugin makes. The route reads the body (an
:class:`~service.admissions.schemas.AdmissionCreate`), asks
:mod:`service.admissions.answer`, and sends the JSON.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.admissions.answer import admission_answer
from service.admissions.schemas import AdmissionCreate, AdmissionPublic
from service.deps import service_state
from service.web.problems import problem_responses
from service.web.routing import JsonBodyRoute, json_body_openapi, read_json_body

router = APIRouter(
    prefix="/v1/admissions",
    route_class=JsonBodyRoute,
    tags=["admissions"],
    responses=problem_responses(401),
)


@router.post(
    "",
    summary="Decide a job's admission: accept with a plan, size it, or refuse",
    response_model=AdmissionPublic,
    responses=problem_responses(400, 413, 415, 422, 503),
    openapi_extra=json_body_openapi(AdmissionCreate),
)
async def create_admission(request: Request) -> Response:
    """The decision for a job: ``outcome``, the allocation (``card``, ``world_size``), the
    ``plan`` and its ``environment``, and the ``reasons`` (with the nearest reachable effective
    batches and the GPU counts that reach the asked one for an unreachable batch).

    A model with no profile on any candidate card answers ``unplanned`` (admit unchanged), not
    404: a scheduler admits what it cannot plan.
    """
    body = await read_json_body(request, AdmissionCreate)
    return Response(
        await admission_answer(body, service_state(request)), media_type="application/json"
    )
