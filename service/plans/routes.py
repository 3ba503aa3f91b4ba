"""``POST /v1/plan``: micro-batch and accumulation steps for an effective batch on N devices.

The route reads the body (a :class:`~service.plans.schemas.PlanCreate`), asks
:mod:`service.plans.answers` the one question it asks (a job of cards, or a plan with its
configs and table), and sends the JSON. Schedulers call it in a loop: it reads its own body and
the app's state rather than through FastAPI's body parameter and a dependency
(``service.web.routing``). What the limit, the device and the budget may be:
:mod:`service.plans.answers`, :mod:`service.plans.devices`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.deps import service_state
from service.plans.answers import job_plan_answer, plan_answer
from service.plans.schemas import PlanCreate, PlanPublic
from service.web.problems import problem_responses
from service.web.routing import JsonBodyRoute, json_body_openapi, read_json_body

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
    body = await read_json_body(request, PlanCreate)
    answer = job_plan_answer if body.job is not None else plan_answer
    return Response(await answer(body, service_state(request)), media_type="application/json")
