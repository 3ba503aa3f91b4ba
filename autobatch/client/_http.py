"""A small typed client for autobatch's HTTP service (httpx), for training scripts and schedulers.

Problem details from the server become autobatch errors in one place
(:func:`autobatch.client._problems.raise_for_problem`):
validation and planning errors :class:`~autobatch.errors.ConfigError` /
:class:`~autobatch.errors.NoFeasiblePlanError`, an unknown profile
:class:`~autobatch.errors.ProfileNotFoundError`, an unavailable store or GPU
:class:`~autobatch.errors.StoreError` / :class:`~autobatch.errors.DeviceUnavailableError`;
everything else (401, 409, 5xx, connection failures) :class:`ServiceError`.

Example::

    with AutobatchClient("http://gpu-node:8000", token=os.environ.get("AUTOBATCH_API_TOKEN")) as c:
        profile_id = c.register_profile(profile)
        p = c.plan(profile_id=profile_id, effective_batch_size=1024, world_size=8,
                   capacity_bytes=80 * 2**30)
        p.micro_batch_size, p.gradient_accumulation_steps
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypedDict, Unpack

import httpx

from autobatch.client._auth import bearer_headers
from autobatch.client._problems import raise_for_problem, unreachable_words
from autobatch.device import GpuInfo, MemoryInfo
from autobatch.errors import ConfigError, ServiceError
from autobatch.planning import Plan, PlanOptions, PlanRequest, SplitOptions, WorldSizeOption
from autobatch.profile import MemoryModel, Profile

__all__ = [
    "AutobatchClient",
    "PlanQuery",
    "PlanQueryOptions",
    "ProbeStatus",
    "QueryOptions",
    "ServiceError",
    "TableQueryOptions",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeStatus:
    """A probe job as the service reports it."""

    id: str
    model: str
    device: str
    status: str
    """``"queued"``, ``"running"``, ``"succeeded"`` or ``"failed"``."""
    num_trials: int
    num_ooms: int
    largest_fitting_micro_batch_size: int
    cached: bool
    """True when the job answered from the server's store without running a step."""
    profile_id: str | None
    profile: Profile | None
    error: str

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")


_DEVICE_FIELDS = ("cuda_index", "uuid", "node_labels", "mig_profile")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanQuery:
    """The body of ``POST /v1/plan`` (the service's ``PlanCreate``): the library's
    :class:`~autobatch.planning.PlanRequest` (checked on construction, by the same checks the
    service runs), where the limit comes from, and the device; see :meth:`AutobatchClient.plan`
    for the fields.

    Example::

        PlanQuery(plan=PlanRequest(effective_batch_size=1024, world_size=8,
                                   capacity_bytes=80 * 2**30),
                  profile_id="3f2a...")
    """

    plan: PlanRequest
    """The effective batch, the ranks, the planner's options; its ``capacity_bytes`` is sent as
    the device's (``device.capacity_bytes``). ``step_seconds`` is the library's alone: the
    service plans from the timings its profiles hold."""
    profile_id: str | None = None
    model_fingerprint: str | None = None
    max_micro_batch_size: int | None = None
    memory_model: MemoryModel | None = None
    cuda_index: int | None = None
    uuid: str | None = None
    node_labels: Mapping[str, str] | None = None
    mig_profile: str | None = None
    gpu_fraction: float | None = None
    card: str | None = None
    """The card type to plan for (with ``model_fingerprint``): see the answer's selection."""
    node: str | None = None
    """The node to plan for (with ``model_fingerprint``)."""
    conditions: Mapping[str, Any] | None = None
    """Conditions the plan must hold under (with ``card`` or ``node``)."""

    def __post_init__(self) -> None:
        if self.plan.step_seconds is not None:
            raise ConfigError(
                "step_seconds is not sent to the service, which plans from the timings its "
                "profiles hold: leave it unset, or plan locally with autobatch.plan"
            )

    def to_json(self) -> dict[str, Any]:
        """The JSON body: unset (None) fields left out, the device fields under ``device``."""
        plan = self.plan
        body: dict[str, Any] = {
            "effective_batch_size": plan.effective_batch_size,
            "world_size": plan.world_size,
            "multiple_of": plan.multiple_of,
            "uneven": plan.uneven,
            "allow_inexact": plan.allow_inexact,
        }
        optional = {
            "world_sizes": None if plan.world_sizes is None else list(plan.world_sizes),
            "max_gradient_accumulation_steps": plan.max_gradient_accumulation_steps,
            "safety_margin": plan.safety_margin,
        }
        device: dict[str, Any] = {}
        if plan.capacity_bytes is not None:
            device["capacity_bytes"] = plan.capacity_bytes
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "plan" or value is None:
                continue
            if isinstance(value, MemoryModel):
                value = dataclasses.asdict(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            if field.name in _DEVICE_FIELDS:
                device[field.name] = value
            else:
                optional[field.name] = value
        body.update((name, value) for name, value in optional.items() if value is not None)
        if device:
            body["device"] = device
        return body


class QueryOptions(TypedDict, total=False):
    """:class:`PlanQuery`'s fields besides ``plan``: where the limit comes from and the device
    (a test keeps the two equal)."""

    profile_id: str | None
    model_fingerprint: str | None
    max_micro_batch_size: int | None
    memory_model: MemoryModel | None
    cuda_index: int | None
    uuid: str | None
    node_labels: Mapping[str, str] | None
    mig_profile: str | None
    gpu_fraction: float | None
    card: str | None
    node: str | None
    conditions: Mapping[str, Any] | None


class PlanQueryOptions(QueryOptions, PlanOptions, total=False):
    """The keyword options of :meth:`AutobatchClient.plan`: :class:`QueryOptions` and the plan's
    (:class:`~autobatch.planning.PlanOptions`)."""


class TableQueryOptions(QueryOptions, SplitOptions, total=False):
    """The keyword options of :meth:`AutobatchClient.plan_world_sizes`: :class:`QueryOptions`
    and the plan's without ``world_size`` (:class:`~autobatch.planning.SplitOptions`)."""


def _query(
    effective_batch_size: int,
    world_sizes: Sequence[int] | None,
    options: PlanQueryOptions | TableQueryOptions,
) -> PlanQuery:
    """The :class:`PlanQuery` of the client's keyword options: the plan's fields into its
    :class:`~autobatch.planning.PlanRequest`, the rest beside it. With ``world_sizes`` the
    primary plan is made at ``min(world_sizes)``.

    Raises:
        ConfigError: a field is invalid (named with its value).
    """
    fields: dict[str, Any] = dict(options)
    query = {name: fields.pop(name) for name in QueryOptions.__optional_keys__ if name in fields}
    if world_sizes is not None:
        fields.update(world_size=min(world_sizes), world_sizes=tuple(world_sizes))
    plan = PlanRequest(effective_batch_size=effective_batch_size, **fields)
    return PlanQuery(plan=plan, **query)


class AutobatchClient:
    """Calls one autobatch service.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        token: bearer token when the server sets one (trimmed of surrounding whitespace).
        timeout: seconds per request.
        transport: an httpx transport (tests pass ``httpx.ASGITransport(app)`` or a mock).

    Raises:
        ConfigError: ``token`` holds a character a header cannot carry (the token not shown).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Accept": "application/json", **bearer_headers(token)}
        self._url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=base_url, headers=headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> AutobatchClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(
        self, method: str, path: str, *, profile_id: str = "", **kwargs: Any
    ) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServiceError(unreachable_words(self._url, exc), status=0) from exc
        raise_for_problem(response, profile_id=profile_id)
        return response

    # -- plans -------------------------------------------------------------------------------

    def plan(self, *, effective_batch_size: int, **options: Unpack[PlanQueryOptions]) -> Plan:
        """``POST /v1/plan``: the plan for ``world_size`` ranks, of the :class:`PlanQuery` the
        keywords build (:class:`PlanQueryOptions`: the
        :class:`~autobatch.planning.PlanRequest` fields and :class:`PlanQuery`'s own). Give
        exactly one limit (``profile_id``, ``model_fingerprint``, ``max_micro_batch_size`` or
        ``memory_model``) and at most one device (``cuda_index``, ``uuid``, ``capacity_bytes``
        or ``node_labels``, with ``mig_profile`` for the MIG slice the job gets on a labelled
        MIG node), with ``gpu_fraction`` the share of that device's card the job gets (0.5: two
        jobs on one card). A plan past the profile's largest measured size has
        ``source == "predicted"`` and its ``prediction``; a plan for a device has its memory
        ``budget`` (the deciding source, the sharing mode, ``fits_now``, ``trials_per_gpu``).
        For the whole answer of a :class:`PlanQuery`, call :meth:`plan_answer`.

        Raises:
            ConfigError: a field is invalid (``step_seconds`` included: the service plans from
                its profiles' timings), or the server rejected the request (the message names
                the field).
            NoFeasiblePlanError: no split meets the constraints.
            ProfileNotFoundError: no such profile (or none for the fingerprint).
            DeviceUnavailableError, StoreError, ServiceError: see the module docstring.
        """
        query = _query(effective_batch_size, None, options)
        return Plan.from_dict(self._post_plan(query)["plan"])

    def plan_world_sizes(
        self,
        *,
        effective_batch_size: int,
        world_sizes: Sequence[int],
        **options: Unpack[TableQueryOptions],
    ) -> list[WorldSizeOption]:
        """The plan at each of ``world_sizes`` (a scheduler choosing N GPUs); options
        (:class:`TableQueryOptions`) and errors as for :meth:`plan`. The primary plan is made at
        ``min(world_sizes)``."""
        query = _query(effective_batch_size, world_sizes, options)
        return [
            WorldSizeOption(
                world_size=row["world_size"],
                plan=None if row["plan"] is None else Plan.from_dict(row["plan"]),
                reason=row["reason"],
            )
            for row in self._post_plan(query)["world_size_options"]
        ]

    def plan_answer(self, query: PlanQuery) -> dict[str, Any]:
        """``POST /v1/plan`` with ``query``: the whole answer as JSON (the service's
        ``PlanPublic``: ``plan``, ``configs``, ``profile_id``, ``device``, ``selection``), for
        callers that need more than the plan, e.g. which profile answered a card's plan and
        whether it was measured there (``answer["selection"]["match"]``).

        Raises:
            as :meth:`plan`.
        """
        return self._post_plan(query)

    def _post_plan(self, query: PlanQuery) -> dict[str, Any]:
        response = self._request(
            "POST", "/v1/plan", profile_id=query.profile_id or "", json=query.to_json()
        )
        data: dict[str, Any] = response.json()
        return data

    # -- profiles ----------------------------------------------------------------------------

    def register_profile(self, profile: Profile) -> str:
        """``POST /v1/profiles``; returns the new id."""
        response = self._request("POST", "/v1/profiles", json=profile.to_dict())
        return str(response.json()["id"])

    def get_profile(self, profile_id: str) -> Profile:
        """``GET /v1/profiles/{id}``.

        Raises:
            ProfileNotFoundError: no profile has this id.
        """
        data = self._request("GET", f"/v1/profiles/{profile_id}", profile_id=profile_id).json()
        return Profile.from_dict(data["profile"])

    def list_profiles(
        self,
        *,
        model_fingerprint: str | None = None,
        device_name: str | None = None,
        limit: int = 100,
        latest_per_node: bool = False,
    ) -> list[tuple[str, Profile]]:
        """``GET /v1/profiles``: ``(id, profile)`` pairs, newest first; with
        ``latest_per_node`` (and ``model_fingerprint``), each node's latest profile of the
        model per thing it measured, what the service's plans draw from."""
        params: dict[str, Any] = {"limit": limit}
        if latest_per_node:
            params["latest_per_node"] = "true"
        if model_fingerprint is not None:
            params["model_fingerprint"] = model_fingerprint
        if device_name is not None:
            params["device_name"] = device_name
        data = self._request("GET", "/v1/profiles", params=params).json()
        return [(row["id"], Profile.from_dict(row["profile"])) for row in data["profiles"]]

    def list_deletions(self, *, after: int = 0, limit: int = 1000) -> tuple[list[str], int]:
        """``GET /v1/profile-deletions``: the ids of profiles the service deleted after cursor
        ``after`` (0: from the first), oldest first, at most ``limit``, and the cursor to ask
        with next (the same when none was deleted since)."""
        params = {"after": str(after), "limit": limit}
        data = self._request("GET", "/v1/profile-deletions", params=params).json()
        return [row["profile_id"] for row in data["deletions"]], int(data["next_after"])

    def delete_profile(self, profile_id: str) -> None:
        """``DELETE /v1/profiles/{id}``.

        Raises:
            ProfileNotFoundError: no profile has this id.
        """
        self._request("DELETE", f"/v1/profiles/{profile_id}", profile_id=profile_id)

    # -- devices and probes ------------------------------------------------------------------

    def list_devices(self) -> list[GpuInfo]:
        """``GET /v1/devices``: the node's GPUs (empty without NVML)."""
        data = self._request("GET", "/v1/devices").json()
        return [
            GpuInfo(
                nvml_index=row["nvml_index"],
                cuda_index=row["cuda_index"],
                uuid=row["uuid"],
                name=row["name"],
                memory=MemoryInfo(
                    total_memory_bytes=row["total_memory_bytes"],
                    free_memory_bytes=row["free_memory_bytes"],
                    used_memory_bytes=row["used_memory_bytes"],
                    reserved_memory_bytes=row["reserved_memory_bytes"],
                    used_includes_reserved=row["used_includes_reserved"],
                    memory_source=row["memory_source"],
                    unified_memory=row["unified_memory"],
                ),
                is_mig=row["is_mig"],
                parent_uuid=row["parent_uuid"],
                mig_profile=row["mig_profile"],
                given=row["given"],
                memory_reason=row["memory_reason"] or "",
                memory_detail=row["memory_detail"] or "",
            )
            for row in data["devices"]
        ]

    def start_probe(
        self, model_name: str, *, device: str | None = None, refresh: bool = False
    ) -> str:
        """``POST /v1/probes`` for a model registered on the server; returns the job id. A
        stored profile that still answers is the job's result unless ``refresh``.

        Raises:
            ConfigError: the model is not registered there.
            ServiceError: the device's queue is full (status 409).
        """
        body: dict[str, Any] = {"model": model_name, "refresh": refresh}
        if device is not None:
            body["device"] = device
        return str(self._request("POST", "/v1/probes", json=body).json()["id"])

    def probe_status(self, probe_id: str) -> ProbeStatus:
        """``GET /v1/probes/{id}``."""
        data = self._request("GET", f"/v1/probes/{probe_id}").json()
        progress = data["progress"]
        return ProbeStatus(
            id=data["id"],
            model=data["model"],
            device=data["device"],
            status=data["status"],
            num_trials=progress["num_trials"],
            num_ooms=progress["num_ooms"],
            largest_fitting_micro_batch_size=progress["largest_fitting_micro_batch_size"],
            cached=data["cached"],
            profile_id=data["profile_id"],
            profile=None if data["profile"] is None else Profile.from_dict(data["profile"]),
            error=data["error"],
        )

    def wait_for_probe(
        self, probe_id: str, *, timeout_seconds: float = 3600.0, poll_seconds: float = 1.0
    ) -> ProbeStatus:
        """Poll :meth:`probe_status` until the job finishes (or ``timeout_seconds`` pass).

        Raises:
            ServiceError: still not finished after ``timeout_seconds``.
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            status = self.probe_status(probe_id)
            if status.done:
                return status
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"probe job {probe_id} still {status.status} after {timeout_seconds} s",
                    status=0,
                )
            time.sleep(poll_seconds)
