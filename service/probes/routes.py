"""``/v1/probes``: probe jobs of models registered in the server's config file.

One job runs at a time per device; later ones wait in a FIFO queue (``max_queued_probes`` per
device); a submission beyond that gets 409. See ``service.probes.runs``.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from autobatch.errors import DeviceUnavailableError
from service.deps import StateDep
from service.devices.gpus import HEALTH_FAILURES, GpuMonitor
from service.probes.registry import cuda_index
from service.probes.runs import Job, UnknownModelError
from service.probes.schemas import ProbeCreate, ProbeList, ProbeProgress, ProbePublic
from service.web.problems import Problem, problem_responses, public_text
from service.web.routing import JsonBodyRoute
from service.web.schemas import IdPath, ProfileBase, TrialBase
from service.web.store_calls import store_call

router = APIRouter(
    prefix="/v1/probes",
    route_class=JsonBodyRoute,
    tags=["probes"],
    responses=problem_responses(401, 403),
)


def probe_public(job: Job) -> ProbePublic:
    return ProbePublic(
        id=job.id,
        model=job.model,
        device=job.device,
        status=job.status,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        queue_position=job.queue_position,
        child_pid=job.child_pid,
        progress=ProbeProgress(
            num_trials=job.num_trials,
            num_ooms=job.num_ooms,
            largest_fitting_micro_batch_size=job.largest_fitting_micro_batch_size,
            last_trial=None
            if job.last_trial is None
            else TrialBase.model_validate(job.last_trial, strict=False),
        ),
        cached=job.cached,
        profile_id=job.profile_id,
        profile=None
        if job.profile is None
        else ProfileBase.model_validate(job.profile, strict=False),
        error=public_text(job.error),
    )


@router.post(
    "",
    status_code=202,
    summary="Start a probe job for a registered model",
    responses=problem_responses(400, 404, 409, 413, 415, 422),
)
async def start_probe(body: ProbeCreate, state: StateDep, response: Response) -> ProbePublic:
    """Queues the job and returns at once (``Location`` names it). A stored profile of the model
    on the device that still answers is the job's result, without a step, unless ``refresh``.
    404 for a model not in the server's registry; 422 for a CUDA device this node does not have;
    409 when the device's queue is full."""
    entry = state.jobs.registry.models.get(body.model)
    if entry is not None:
        await _check_cuda_device(body.device or entry.device, state.gpus, body.device is None)
    try:
        job = state.jobs.submit(body.model, device=body.device, refresh=body.refresh)
    except UnknownModelError as exc:
        raise Problem(404, "unknown-model", str(exc), field="body.model") from exc
    response.headers["Location"] = f"/v1/probes/{job.id}"
    return probe_public(job)


async def _check_cuda_device(device: str, gpus: GpuMonitor, from_registry: bool) -> None:
    """422 now, rather than a job failing seconds later, for ``cuda:N`` with no such GPU in the
    device set this container was given (the job's child sees the same numbering)."""
    index = cuda_index(device)
    if index is None:
        return
    try:
        inventory = await gpus.inventory()
        visible = sorted(d.cuda_index for d in inventory.devices if d.cuda_index is not None)
    except DeviceUnavailableError as exc:
        if exc.reason in HEALTH_FAILURES:
            raise  # NVML hangs or lost a GPU: 503, not "no such device"
        reason = f"this node has no usable GPU ({exc})"
    else:
        if index in visible:
            return
        reason = f"this node has no GPU with CUDA index {index} (visible: {visible or 'none'})"
    where = "the registry's device for this model" if from_registry else "device"
    raise Problem(
        422,
        "unknown-device",
        f'{where} {device!r}: {reason}; give a device this node has, e.g. "sim:16GiB"',
        field="body.model" if from_registry else "body.device",
    )


@router.get("", summary="List probe jobs, newest first")
def list_probes(state: StateDep) -> ProbeList:
    return ProbeList(probes=[probe_public(job) for job in state.jobs.list_jobs()])


@router.get(
    "/{probe_id}",
    summary="A probe job's status, progress and profile",
    responses=problem_responses(404, 422),
)
async def get_probe(probe_id: IdPath, state: StateDep) -> ProbePublic:
    """A job of an earlier run of the server is read from the store: on the store's threads,
    under the store deadline (``service.web.store_calls``)."""
    return probe_public(await store_call(state, state.jobs.get, probe_id))
