"""``/v1/probes``: probe runs of models registered in the server's config file.

One run at a time per device; later ones wait in a FIFO queue (``max_queued_probes`` per
device); a submission beyond that gets 409. See ``service.probes.runs``.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.deps import StateDep
from service.probes.runs import ProbeRun, QueueFullError, UnknownModelError, UnknownProbeRunError
from service.probes.schemas import ProbeCreate, ProbeList, ProbeProgress, ProbePublic
from service.probes.starting import start_run
from service.web.problems import problem_responses, public_text
from service.web.routing import JsonBodyRoute
from service.web.schemas import IdPath
from service.web.store_calls import store_call

PROBE_RUN_ERRORS = (
    (UnknownModelError, 404, "unknown-model"),
    (UnknownProbeRunError, 404, "unknown-job"),
    (QueueFullError, 409, "queue-full"),
)
"""What a probe run's errors answer, wherever they are raised (``install_problem_handlers``).
The slug ``unknown-job`` is the API's word, kept for the clients that switch on it."""

router = APIRouter(
    prefix="/v1/probes",
    route_class=JsonBodyRoute,
    tags=["probes"],
    responses=problem_responses(401, 403),
)


def probe_public(run: ProbeRun) -> ProbePublic:
    return ProbePublic(
        id=run.id,
        model=run.model,
        device=run.device,
        status=run.status,
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
        queue_position=run.queue_position,
        child_pid=run.child_pid,
        progress=ProbeProgress(
            num_trials=run.num_trials,
            num_ooms=run.num_ooms,
            largest_fitting_micro_batch_size=run.largest_fitting_micro_batch_size,
            last_trial=run.last_trial,
        ),
        cached=run.cached,
        profile_id=run.profile_id,
        profile=run.profile,
        error=public_text(run.error),
    )


@router.post(
    "",
    status_code=202,
    summary="Start a probe run for a registered model",
    responses=problem_responses(400, 404, 409, 413, 415, 422),
)
async def start_probe(body: ProbeCreate, state: StateDep, response: Response) -> ProbePublic:
    """Queues the run and returns at once (``Location`` names it). A stored profile of the model
    on the device that still answers is the run's result, without a step, unless ``refresh``.
    404 for a model not in the server's registry; 422 for a CUDA device this node does not have;
    409 when the device's queue is full."""
    run = await start_run(body, state.runs, state.gpus)
    response.headers["Location"] = f"/v1/probes/{run.id}"
    return probe_public(run)


@router.get("", summary="List probe runs, newest first")
def list_probes(state: StateDep) -> ProbeList:
    return ProbeList(probes=[probe_public(run) for run in state.runs.list_runs()])


@router.get(
    "/{probe_id}",
    summary="A probe run's status, progress and profile",
    responses=problem_responses(404, 422),
)
async def get_probe(probe_id: IdPath, state: StateDep) -> ProbePublic:
    """A run from before the server restarted is read from the store: on the store's threads,
    under the store deadline (``service.web.store_calls``)."""
    return probe_public(await store_call(state, state.runs.get, probe_id))
