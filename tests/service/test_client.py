"""autobatch.client._http against the real app in-process (httpx transport over TestClient)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.client._http import AutobatchClient, ServiceError
from autobatch.client._problems import unreachable_words
from autobatch.client._publish import RetryPolicy, publish_profile, report_profile
from autobatch.errors import ConfigError, NoFeasiblePlanError, ProfileNotFoundError
from autobatch.profile import MemoryModel
from tests.helpers.fake_pynvml import GiB
from tests.service.conftest import A100_UUID
from tests.service.test_service_api import make_profile


def transport_for(app: FastAPI) -> httpx.MockTransport:
    """An httpx transport that hands each request to the app through TestClient (whose own
    transport belongs to another httpx distribution here)."""
    test_client = TestClient(app)

    def forward(request: httpx.Request) -> httpx.Response:
        response = test_client.request(
            request.method,
            request.url.raw_path.decode(),
            headers=dict(request.headers),
            content=request.content,
        )
        return httpx.Response(
            response.status_code, headers=response.headers.multi_items(), content=response.content
        )

    return httpx.MockTransport(forward)


def client_for(app: FastAPI, token: str | None = None) -> AutobatchClient:
    return AutobatchClient("http://testserver", token=token, transport=transport_for(app))


@pytest.fixture
def api(make_app: Callable[..., FastAPI]) -> AutobatchClient:
    return client_for(make_app())


def test_profiles_round_trip(api: AutobatchClient) -> None:
    profile = make_profile()
    profile_id = api.register_profile(profile)
    assert api.get_profile(profile_id) == profile
    assert api.list_profiles(model_fingerprint="fp-gpt2") == [(profile_id, profile)]
    api.delete_profile(profile_id)
    with pytest.raises(ProfileNotFoundError, match="no profile with id") as info:
        api.get_profile(profile_id)
    assert info.value.profile_id == profile_id


def test_plan_returns_a_library_plan(api: AutobatchClient) -> None:
    plan = api.plan(max_micro_batch_size=24, effective_batch_size=96, world_size=2)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.world_size) == (24, 2, 2)
    profile_id = api.register_profile(make_profile())
    plan = api.plan(profile_id=profile_id, effective_batch_size=72)
    assert plan.gradient_accumulation_steps == 2 and plan.source == "cached"
    assert plan.prediction is None
    plan = api.plan(profile_id=profile_id, effective_batch_size=72, capacity_bytes=80 * GiB)
    # Past the profile's largest measured size: predicted, and the client carries how far.
    assert plan.gradient_accumulation_steps == 1 and plan.source == "predicted"
    assert plan.prediction is not None
    assert plan.prediction.largest_measured_micro_batch_size < 72 <= plan.max_micro_batch_size
    plan = api.plan(
        memory_model=MemoryModel(fixed_bytes=0, bytes_per_sample=GiB),
        uuid=A100_UUID,
        safety_margin=0.0,
        effective_batch_size=160,
    )
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (80, 2)


def test_plan_for_a_mig_slice_from_node_labels(api: AutobatchClient) -> None:
    labels = {
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/gpu.memory": "40537",
        "nvidia.com/mig-1g.5gb.memory": "4864",
    }
    plan = api.plan(
        memory_model=MemoryModel(fixed_bytes=0, bytes_per_sample=GiB),
        node_labels=labels,
        mig_profile="1g.5gb",
        safety_margin=0.0,
        effective_batch_size=8,
    )
    assert plan.capacity_bytes == 4864 * 2**20  # the slice, not the 40 GB card
    assert plan.max_micro_batch_size == 4


def test_plan_world_sizes(api: AutobatchClient) -> None:
    rows = api.plan_world_sizes(
        max_micro_batch_size=24, effective_batch_size=96, world_sizes=[2, 4, 5]
    )
    assert [
        (r.world_size, r.plan.gradient_accumulation_steps if r.plan else None) for r in rows
    ] == [
        (2, 2),
        (4, 1),
        (5, None),
    ]


def test_errors_become_autobatch_errors(api: AutobatchClient) -> None:
    with pytest.raises(ConfigError, match="not a multiple of world_size 4"):
        api.plan(max_micro_batch_size=8, effective_batch_size=10, world_size=4)
    with pytest.raises(ConfigError, match="max_micro_batch_size"):
        api.plan(max_micro_batch_size=0, effective_batch_size=10)
    with pytest.raises(NoFeasiblePlanError, match="micro-batch size 1"):
        api.plan(
            memory_model=MemoryModel(fixed_bytes=50 * GiB, bytes_per_sample=1),
            capacity_bytes=40 * GiB,
            effective_batch_size=8,
        )
    with pytest.raises(ConfigError, match="not registered"):
        api.start_probe("resnet")


def test_a_missing_profile_names_the_id_asked_for(api: AutobatchClient) -> None:
    with pytest.raises(ProfileNotFoundError, match="x") as planned:
        api.plan(profile_id="x", effective_batch_size=8)
    assert planned.value.profile_id == "x"  # not "plan", the last part of the URL
    with pytest.raises(ProfileNotFoundError) as fingerprinted:
        api.plan(model_fingerprint="no-such-model", effective_batch_size=8)
    assert fingerprinted.value.profile_id == ""  # the request named no profile id
    with pytest.raises(ProfileNotFoundError) as deleted:
        api.delete_profile("y")
    assert deleted.value.profile_id == "y"


def test_plan_request_body_leaves_out_what_is_unset_and_groups_the_device() -> None:
    from autobatch.client import PlanQuery
    from autobatch.planning import PlanRequest

    body = PlanQuery(
        plan=PlanRequest(effective_batch_size=64, world_sizes=(1, 2), capacity_bytes=2**30),
        memory_model=MemoryModel(fixed_bytes=3, bytes_per_sample=2),
        node_labels={"nvidia.com/gpu.product": "NVIDIA-H100"},
    ).to_json()
    assert body == {
        "effective_batch_size": 64,
        "world_size": 1,
        "world_sizes": [1, 2],
        "memory_model": {"fixed_bytes": 3, "bytes_per_sample": 2},
        "multiple_of": 1,
        "uneven": "auto",
        "allow_inexact": False,
        "device": {
            "capacity_bytes": 2**30,
            "node_labels": {"nvidia.com/gpu.product": "NVIDIA-H100"},
        },
    }


def test_plan_query_checks_its_plan_where_the_library_does_and_refuses_step_seconds() -> None:
    from autobatch.client import PlanQuery
    from autobatch.planning import PlanRequest

    with pytest.raises(ConfigError, match="safety_margin 1.5"):
        PlanQuery(plan=PlanRequest(effective_batch_size=8, safety_margin=1.5), profile_id="p")
    with pytest.raises(ConfigError, match="step_seconds is not sent to the service"):
        PlanQuery(plan=PlanRequest(effective_batch_size=8, step_seconds={1: 0.1, 2: 0.2}))


def test_devices(api: AutobatchClient) -> None:
    gpus = api.list_devices()
    assert [(g.cuda_index, g.memory.total_memory_bytes) for g in gpus] == [
        (0, 80 * GiB),
        (1, 94 * GiB),
    ]


def test_token(make_app: Callable[..., FastAPI]) -> None:
    app = make_app(api_token="tok")
    with pytest.raises(ServiceError, match="bearer token") as info:
        client_for(app).list_devices()
    assert info.value.status == 401
    assert len(client_for(app, token="tok").list_devices()) == 2


def test_unreachable_server_is_a_service_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    client = AutobatchClient("http://127.0.0.1:9/", transport=httpx.MockTransport(refuse))
    with pytest.raises(ServiceError) as info:
        client.list_devices()
    assert info.value.status == 0
    assert str(info.value) == (
        "could not connect to http://127.0.0.1:9: connection refused (is the service running?)"
    )


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (httpx.ConnectError("[Errno 111] Connection refused"), "connection refused (is the "
         "service running?)"),
        (httpx.ConnectError("[Errno -2] Name or service not known"), "no host of that name "
         "(is the URL right?)"),
        (httpx.ConnectTimeout("timed out"), "no answer in time (is the service running, and "
         "the URL right?)"),
        (httpx.RemoteProtocolError("Server disconnected"), "server disconnected"),
    ],
)  # fmt: skip
def test_a_connection_failure_reads_as_words_never_errno(exc: httpx.HTTPError, reason: str) -> None:
    assert (
        unreachable_words("http://h:8000", exc) == f"could not connect to http://h:8000: {reason}"
    )


def test_a_refused_connection_reads_the_same_for_the_client_and_a_report() -> None:
    # A real refusal: a port bound then closed, so nothing listens on it.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    words = f"could not connect to {url}: connection refused (is the service running?)"
    with AutobatchClient(url) as client, pytest.raises(ServiceError) as info:
        client.list_profiles()
    assert str(info.value) == words
    once = RetryPolicy(max_attempts=1)
    with pytest.raises(ServiceError) as info:
        publish_profile(url, make_profile(), policy=once)
    assert str(info.value).endswith(f"; last: {words}") and "Errno" not in str(info.value)


def test_report_profile_is_what_autotune_report_to_calls(make_app: Callable[..., FastAPI]) -> None:
    app = make_app()
    profile = make_profile()
    profile_id = report_profile("http://testserver", profile, transport=transport_for(app))
    assert app.state.service.store.get(profile_id) == profile


def test_the_keyword_options_are_the_query_and_request_fields() -> None:
    import dataclasses

    from autobatch.client import PlanQuery
    from autobatch.client._http import PlanQueryOptions, QueryOptions, TableQueryOptions
    from autobatch.planning import PlanOptions, PlanRequest, SplitOptions

    query_fields = {field.name for field in dataclasses.fields(PlanQuery)} - {"plan"}
    assert set(QueryOptions.__optional_keys__) == query_fields
    request_fields = {field.name for field in dataclasses.fields(PlanRequest)}
    plan_keywords = set(PlanQueryOptions.__optional_keys__) | {"effective_batch_size"}
    assert plan_keywords == query_fields | request_fields - {"world_sizes"}
    table_keywords = set(TableQueryOptions.__optional_keys__) | {"effective_batch_size"}
    assert table_keywords | {"world_sizes"} == query_fields | request_fields - {"world_size"}
    assert set(PlanOptions.__optional_keys__) - set(SplitOptions.__optional_keys__) == {
        "world_size"
    }


def test_the_keyword_calls_post_the_query_they_build() -> None:
    from autobatch.client import PlanQuery
    from autobatch.planning import PlanRequest, plan_request

    sent: list[dict[str, object]] = []
    planned = plan_request(24, PlanRequest(effective_batch_size=96, world_size=2))
    answer = {"plan": planned.to_dict(), "world_size_options": []}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=answer)

    with AutobatchClient("http://x", transport=httpx.MockTransport(handler)) as client:
        client.plan(
            max_micro_batch_size=24,
            effective_batch_size=96,
            world_size=2,
            card="H100",
            gpu_fraction=0.5,
        )
        client.plan_world_sizes(profile_id="p", effective_batch_size=96, world_sizes=[4, 2])
        with pytest.raises(ConfigError, match="step_seconds is not sent to the service"):
            client.plan(profile_id="p", effective_batch_size=8, step_seconds={1: 0.1, 2: 0.2})
    one = PlanQuery(
        plan=PlanRequest(effective_batch_size=96, world_size=2),
        max_micro_batch_size=24,
        card="H100",
        gpu_fraction=0.5,
    )
    table = PlanQuery(
        plan=PlanRequest(effective_batch_size=96, world_size=2, world_sizes=(4, 2)),
        profile_id="p",
    )
    assert sent == [one.to_json(), table.to_json()]
    assert sent[1]["world_size"] == 2  # the primary plan at the smallest world size
