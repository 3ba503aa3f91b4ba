"""Every endpoint through TestClient, good and bad input, NVML faked at the pynvml boundary."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

import autobatch
from autobatch.cli import main as cli_main
from autobatch.cli._wording import human_bytes
from autobatch.planning import Plan, PlanRequest, given_budget, plan_request, plan_table
from autobatch.profile import MemoryModel, ProbeTimings, Profile, StepIdentity, Trial
from service.plans.schemas import PlanPublic
from service.probes.runs import queue_key
from service.web.middleware import token_matches
from service.web.routing import is_json_media_type
from service.web.wording import field_text
from tests.helpers.fake_pynvml import GiB, MiB
from tests.service.conftest import A100_UUID, H100_UUID, no_nvml

PROBLEM = "application/problem+json"


def make_profile(**changes: Any) -> Profile:
    fields: dict[str, Any] = {
        "max_micro_batch_size": 40,
        "recommended_micro_batch_size": 36,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (
            Trial(micro_batch_size=1, fits=True, peak_allocated_bytes=3 * GiB, warm_up=True),
            Trial(
                micro_batch_size=32,
                fits=True,
                peak_allocated_bytes=20 * GiB,
                peak_reserved_bytes=20 * GiB,
            ),
            Trial(micro_batch_size=48, fits=False, oom=True, error="OutOfMemoryError"),
        ),
        "num_steps": 3,
        "device_name": "NVIDIA A100-SXM4-80GB",
        "device_type": "cuda",
        "total_memory_bytes": 80 * GiB,
        "capacity_bytes": 40 * GiB,
        "memory_model": MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=GiB // 2),
        "model_fingerprint": "fp-gpt2",
        "torch_version": "2.13.0",
        "created_at": "2026-11-30T04:00:00+00:00",
    }
    fields.update(changes)
    identity = {k: fields.pop(k) for k in list(fields) if k in StepIdentity.__dataclass_fields__}
    return Profile(**fields, identity=StepIdentity(**identity))


def problem(response: Any, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["type"] == f"urn:autobatch:problem:{slug}"
    assert body["status"] == status
    return body


def fields(body: dict[str, Any]) -> list[str]:
    return [error["field"] for error in body["errors"]]


# -- health ------------------------------------------------------------------------------------


def test_healthz_checks_nothing_but_the_process(make_app: Callable[..., FastAPI]) -> None:
    client = TestClient(make_app(nvml=no_nvml(), require_gpu=True))
    assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_reports_store_and_nvml(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    body = response.json()
    assert body["ready"] and body["store_writable"] and body["nvml_available"]
    assert body["num_gpus"] == 2


def test_readyz_503_when_a_required_gpu_is_missing(make_app: Callable[..., FastAPI]) -> None:
    response = TestClient(make_app(nvml=no_nvml(), require_gpu=True)).get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert (body["ready"], body["store_writable"], body["nvml_available"]) == (False, True, False)
    assert body["nvml_reason"] == "driver_not_loaded"
    assert "kernel driver is not loaded" in body["nvml_detail"]


def test_readyz_ready_without_gpu_when_not_required(make_app: Callable[..., FastAPI]) -> None:
    response = TestClient(make_app(nvml=no_nvml())).get("/readyz")
    assert response.status_code == 200
    assert response.json()["num_gpus"] == 0


def test_readyz_503_when_the_store_is_not_writable(make_app: Callable[..., FastAPI]) -> None:
    app = make_app()
    app.state.service.store.close()
    response = TestClient(app).get("/readyz")
    assert response.status_code == 503
    assert response.json()["store_writable"] is False
    assert "closed" in response.json()["store_detail"]


def test_metrics_count_requests_and_show_gpu_memory(client: TestClient) -> None:
    client.post("/v1/plan", json={"max_micro_batch_size": 8, "effective_batch_size": 16})
    client.post("/v1/plan", json={"max_micro_batch_size": 0, "effective_batch_size": 16})
    client.get("/v1/profiles/nope")
    text = client.get("/metrics").text
    assert 'autobatch_http_requests_total{method="POST",route="/v1/plan",status="200"} 1.0' in text
    assert 'autobatch_http_requests_total{method="POST",route="/v1/plan",status="422"} 1.0' in text
    assert (
        'autobatch_http_requests_total{method="GET",route="/v1/profiles/{profile_id}",status="404"}'
        in text
    )
    gpu_labels = f'name="NVIDIA A100-SXM4-80GB",nvml_index="0",uuid="{A100_UUID}"'
    assert f"autobatch_gpu_memory_total_bytes{{{gpu_labels}}} 8.589934592e+10" in text
    assert 'autobatch_probe_jobs_total{event="failed"} 0.0' in text
    assert "autobatch_probe_ooms_total 0.0" in text


# -- devices -----------------------------------------------------------------------------------


def test_devices_lists_gpus_from_nvml(client: TestClient) -> None:
    body = client.get("/v1/devices").json()
    assert body["reason"] is None
    assert [(d["cuda_index"], d["uuid"], d["name"]) for d in body["devices"]] == [
        (0, A100_UUID, "NVIDIA A100-SXM4-80GB"),
        (1, H100_UUID, "NVIDIA H100 NVL"),
    ]
    first = body["devices"][0]
    assert (first["total_memory_bytes"], first["free_memory_bytes"]) == (80 * GiB, 79 * GiB)
    assert first["is_mig"] is False


def test_devices_empty_with_reason_without_nvml(make_app: Callable[..., FastAPI]) -> None:
    body = TestClient(make_app(nvml=no_nvml())).get("/v1/devices").json()
    assert body["devices"] == []
    assert body["reason"] == "driver_not_loaded"
    assert "modprobe nvidia" in body["detail"]


# -- plans -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_body",
    [
        {"max_micro_batch_size": 24, "effective_batch_size": 64},
        {"max_micro_batch_size": 24, "effective_batch_size": 97},  # uneven: null configs
        {"max_micro_batch_size": 24, "effective_batch_size": 96, "world_sizes": [1, 5, 8]},
        {
            "memory_model": {"fixed_bytes": GiB, "bytes_per_sample": GiB},
            "device": {"capacity_bytes": 40 * GiB},
            "effective_batch_size": 120,
            "world_size": 2,
            "world_sizes": [2, 7],
        },
        {
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
            "effective_batch_size": 8,
            "device": {"cuda_index": 0},
        },
    ],
)
def test_plan_responses_are_exactly_plan_public(
    client: TestClient, request_body: dict[str, Any]
) -> None:
    # The route builds its JSON from plain dicts (no model on the hot path): the result must
    # still be a PlanPublic, field for field, with nothing extra.
    response = client.post("/v1/plan", json=request_body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    public = PlanPublic.model_validate(body, strict=True)
    assert public.model_dump(mode="json") == body
    for row in body["world_size_options"] or []:
        assert row["plan"] is None or row["plan"]["world_size"] == row["world_size"]


def test_plan_from_a_max_micro_batch_size_with_configs(client: TestClient) -> None:
    response = client.post(
        "/v1/plan", json={"max_micro_batch_size": 24, "effective_batch_size": 64}
    )
    assert response.status_code == 200
    body = response.json()
    plan = body["plan"]
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (16, 4)
    assert plan["source"] == "given" and plan["world_size"] == 1
    assert body["configs"]["deepspeed"] == {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 4,
    }
    assert body["configs"]["hf_training_arguments"] == {
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 4,
    }
    assert body["configs"]["lightning"]["trainer"] == {"accumulate_grad_batches": 4}
    assert body["world_size_options"] is None


def test_plan_world_sizes_table(client: TestClient) -> None:
    body = client.post(
        "/v1/plan",
        json={"max_micro_batch_size": 24, "effective_batch_size": 96, "world_sizes": [1, 2, 5, 8]},
    ).json()
    rows = body["world_size_options"]
    assert [row["world_size"] for row in rows] == [1, 2, 5, 8]
    assert [
        (r["plan"]["micro_batch_size"], r["plan"]["gradient_accumulation_steps"])
        for r in rows
        if r["plan"]
    ] == [(24, 4), (24, 2), (12, 1)]
    assert rows[2]["plan"] is None and rows[2]["reason"] == (
        'effective_batch_size 96 is not a multiple of world_size 5; use "effective_batch_size": '
        '95 or 100, or "allow_inexact": true (plan the nearest)'
    )


def test_plan_uneven_has_no_framework_configs(client: TestClient) -> None:
    body = client.post(
        "/v1/plan", json={"max_micro_batch_size": 24, "effective_batch_size": 97}
    ).json()
    assert body["plan"]["micro_batch_sizes"] == [20, 20, 19, 19, 19]
    assert body["configs"]["deepspeed"] is None
    assert "unequal micro-batches" in body["configs"]["reason"]


def test_plan_from_a_memory_model_and_capacity(client: TestClient) -> None:
    body = client.post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 10 * GiB, "bytes_per_sample": GiB},
            "device": {"capacity_bytes": 40 * GiB},
            "safety_margin": 0.0,
            "effective_batch_size": 120,
            "world_size": 2,
        },
    ).json()
    plan = body["plan"]
    # (40 - 10) GiB / 1 GiB per sample = 30 per micro-batch; 60 per rank -> 2 steps of 30.
    assert (plan["max_micro_batch_size"], plan["micro_batch_size"]) == (30, 30)
    assert plan["gradient_accumulation_steps"] == 2
    assert plan["predicted_peak_memory_bytes"] == 40 * GiB
    assert plan["headroom_bytes"] == 0
    assert plan["source"] == "given"
    assert {key: body["device"][key] for key in ("source", "capacity_bytes", "name", "uuid")} == {
        "source": "capacity_bytes",
        "capacity_bytes": 40 * GiB,
        "name": None,
        "uuid": None,
    }
    assert body["device"]["warnings"] == []


def test_plan_for_kubernetes_gpu_labels(client: TestClient) -> None:
    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920"}
    body = client.post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
            "device": {"node_labels": labels},
            "safety_margin": 0.5,
            "effective_batch_size": 40,
        },
    ).json()
    assert body["device"]["capacity_bytes"] == 81920 * MiB
    assert body["device"]["name"] == "NVIDIA-A100-SXM4-80GB"
    assert body["plan"]["max_micro_batch_size"] == 40  # 80 GiB * 0.5 / 1 GiB


@pytest.mark.parametrize("mib", ["lots", "²", "８１９２０", "0", "-5", " 81920", str(2**50 + 1)])
def test_plan_labels_without_memory_is_422_with_field(client: TestClient, mib: str) -> None:
    # "²".isdigit() is true but int("²") raises: only ASCII digits are a size.
    response = client.post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
            "device": {"node_labels": {"nvidia.com/gpu.memory": mib}},
            "effective_batch_size": 40,
        },
    )
    body = problem(response, 422, "validation")
    assert fields(body) == ["body.device.node_labels.nvidia.com/gpu.memory"]


@pytest.mark.parametrize(
    ("device", "capacity"),
    [
        ({"cuda_index": 1}, 94 * GiB),
        ({"uuid": A100_UUID}, 80 * GiB),
        ({"uuid": A100_UUID, "memory": "free"}, 79 * GiB),
    ],
)
def test_plan_for_a_local_gpu(client: TestClient, device: dict[str, Any], capacity: int) -> None:
    body = client.post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
            "device": device,
            "safety_margin": 0.0,
            "effective_batch_size": 8,
        },
    ).json()
    assert body["device"]["capacity_bytes"] == capacity
    assert body["plan"]["max_micro_batch_size"] == capacity // GiB


def test_plan_unknown_local_gpu_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
            "device": {"cuda_index": 7},
            "effective_batch_size": 8,
        },
    )
    assert fields(problem(response, 422, "unknown-device")) == ["body.device.cuda_index"]


def test_plan_local_gpu_without_nvml_is_503(make_app: Callable[..., FastAPI]) -> None:
    response = TestClient(make_app(nvml=no_nvml())).post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
            "device": {"cuda_index": 0},
            "effective_batch_size": 8,
        },
    )
    problem(response, 503, "device-unavailable")


def test_a_profiles_conditions_round_trip_and_its_plans_expose_them(client: TestClient) -> None:
    from autobatch.conditions import Conditions

    conditions = Conditions(
        device_type="cuda",
        allocator_settings="expandable_segments:True",
        allocator_source="torch",
        allocator_backend="native",
        allocator_environment={"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        cudnn={"benchmark": "True", "deterministic": "False", "enabled": "True"},
        amp_dtype="bfloat16",
        parameter_bytes={"bfloat16": 248 * MiB},
        gradient_bytes={"bfloat16": 248 * MiB},
        optimizer_state_bytes={"float32": 992 * MiB},
        num_parameters=124 * 2**20,
        num_trainable_parameters=124 * 2**20,
        activation_checkpointing="none detected",
        optimizer="torch.optim.adamw.AdamW",
        optimizer_state_dtype="float32",
        world_size=8,
        world_size_source="the default process group",
    )
    profile = make_profile(conditions=conditions)
    profile_id = client.post("/v1/profiles", json=profile.to_dict()).json()["id"]
    stored = client.get(f"/v1/profiles/{profile_id}").json()["profile"]
    assert Profile.from_dict(stored).conditions == conditions
    body = client.post(
        "/v1/plan", json={"profile_id": profile_id, "effective_batch_size": 72}
    ).json()
    PlanPublic.model_validate(body)
    assert Plan.from_dict(body["plan"]).conditions == conditions


def test_plan_from_a_stored_profile_is_cached(client: TestClient) -> None:
    profile_id = client.post("/v1/profiles", json=make_profile().to_dict()).json()["id"]
    body = client.post(
        "/v1/plan", json={"profile_id": profile_id, "effective_batch_size": 72}
    ).json()
    assert body["profile_id"] == profile_id
    assert (body["plan"]["micro_batch_size"], body["plan"]["gradient_accumulation_steps"]) == (
        36,
        2,
    )
    assert body["plan"]["source"] == "cached"
    # On an 80 GiB card the memory model allows (76 GiB - 4 GiB) / 0.5 GiB = 144 -> 72 in one step.
    body = client.post(
        "/v1/plan",
        json={
            "profile_id": profile_id,
            "effective_batch_size": 72,
            "device": {"capacity_bytes": 80 * GiB},
        },
    ).json()
    assert body["plan"]["gradient_accumulation_steps"] == 1
    assert body["plan"]["predicted_peak_memory_bytes"] == 4 * GiB + 72 * (GiB // 2)
    # 72 is past the largest size that really ran (32): predicted, from the stored line.
    assert body["plan"]["source"] == "predicted"
    assert body["plan"]["prediction"]["largest_measured_micro_batch_size"] == 32
    assert body["plan"]["prediction"]["num_fit_points"] == 0


def test_the_answer_carries_the_library_plans_as_their_to_dict(client: TestClient) -> None:
    """The route serializes Plans with pydantic-core, which writes a dataclass as its fields:
    that must stay Plan.to_dict(), prediction and notes included, in the plan and in every row."""
    profile = make_profile()
    profile_id = client.post("/v1/profiles", json=profile.to_dict()).json()["id"]
    request = {"effective_batch_size": 288, "capacity_bytes": 80 * GiB}
    body = client.post(
        "/v1/plan",
        json={
            "profile_id": profile_id,
            "effective_batch_size": 288,
            "world_size": 2,
            "world_sizes": [1, 2, 5],
            "device": {"capacity_bytes": request["capacity_bytes"]},
        },
    ).json()
    # ...and the memory budget the device gave, completed for each plan's peak.
    budget = given_budget(80 * GiB)
    wanted = PlanRequest(world_size=2, world_sizes=(1, 2, 5), **request)
    expected = plan_request(profile, wanted, budget=budget, source="cached")
    assert expected.prediction is not None and len(expected.notes) >= 2  # the fields that nest
    assert expected.budget is not None and expected.budget.trials_per_gpu  # it nests too
    # The notes in the service's words (a library call as its route: field_text).
    assert body["plan"] == {**expected.to_dict(), "notes": list(map(field_text, expected.notes))}
    rows = plan_table(profile, wanted, budget=budget, source="cached")
    assert [row["plan"] for row in body["world_size_options"]] == [
        None
        if row.plan is None
        else {**row.plan.to_dict(), "notes": list(map(field_text, row.plan.notes))}
        for row in rows
    ]
    assert body["world_size_options"][2]["plan"] is None  # 288 is not a multiple of 5


def test_the_same_stored_profile_reads_the_same_source_by_cli_and_by_service(
    make_app: Callable[..., FastAPI], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `autobatch plan --profile ID` and POST /v1/plan name the same source for one profile.
    store_path = str(tmp_path / "shared.sqlite3")
    client = TestClient(make_app(store_path=store_path))
    profile_id = client.post("/v1/profiles", json=make_profile().to_dict()).json()["id"]
    for device, expected in (({}, "cached"), ({"capacity_bytes": 80 * GiB}, "predicted")):
        request = {"profile_id": profile_id, "effective_batch_size": 72}
        if device:
            request["device"] = device
        served = client.post("/v1/plan", json=request).json()["plan"]
        argv = ["--store", store_path, "plan", "--profile", profile_id]
        argv += ["--effective-batch-size", "72", "--json"]
        argv += ["--capacity", str(80 * GiB)] if device else []
        assert cli_main(argv) == 0
        printed = json.loads(capsys.readouterr().out)["plan"]
        assert served["source"] == printed["source"] == expected
        # Alike but for the notes, each in its surface's words (a route, a command; byte
        # counts on the command line in units).
        assert {**served, "notes": []} == {**printed, "notes": []}
        assert [
            human_bytes(note.replace("POST /v1/probes", "autobatch tune"))
            for note in served["notes"]
        ] == printed["notes"]
        assert "4.00 GiB + 512.00 MiB per sample" in " ".join(printed["notes"]) or not device


def test_plan_by_model_fingerprint_prefers_the_same_gpu(client: TestClient) -> None:
    client.post("/v1/profiles", json=make_profile(device_name="other").to_dict())
    on_a100 = client.post("/v1/profiles", json=make_profile().to_dict()).json()["id"]
    client.post("/v1/profiles", json=make_profile(device_name="newest").to_dict())
    body = client.post(
        "/v1/plan",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 64,
            "device": {"cuda_index": 0},
        },
    ).json()
    assert body["profile_id"] == on_a100


def test_plan_from_a_profile_bounded_by_a_launch_limit_says_so(client: TestClient) -> None:
    launch = "RuntimeError: CUDA error: invalid configuration argument"
    trials = (
        *make_profile().trials[:2],
        Trial(micro_batch_size=41, fits=False, error=launch),
        Trial(micro_batch_size=40, fits=True, peak_allocated_bytes=24 * GiB),
    )
    profile = make_profile(trials=trials, failed_micro_batch_size=41, stop_kind="failure")
    profile_id = client.post("/v1/profiles", json=profile.to_dict()).json()["id"]
    body = client.post(
        "/v1/plan", json={"profile_id": profile_id, "effective_batch_size": 72}
    ).json()
    assert body["plan"]["micro_batch_size"] <= 40
    assert profile.failure_note in body["plan"]["notes"]
    assert "micro-batch 41 failed for a reason other than memory" in profile.failure_note
    assert launch in profile.failure_note


def test_plan_unknown_profile_is_404(client: TestClient) -> None:
    response = client.post("/v1/plan", json={"profile_id": "feedbeef", "effective_batch_size": 8})
    body = problem(response, 404, "unknown-profile")
    assert fields(body) == ["body.profile_id"]
    assert body["detail"] == "no profile with id 'feedbeef'"  # not the store's file path
    response = client.post(
        "/v1/plan", json={"model_fingerprint": "nope", "effective_batch_size": 8}
    )
    assert fields(problem(response, 404, "unknown-profile")) == ["body.model_fingerprint"]


def test_plan_library_errors_are_422(client: TestClient) -> None:
    response = client.post(
        "/v1/plan", json={"max_micro_batch_size": 8, "effective_batch_size": 10, "world_size": 4}
    )
    body = problem(response, 422, "invalid-config")
    assert (  # the remedies as the request's fields, not Python's arguments
        'not a multiple of world_size 4; use "effective_batch_size": 8 or 12, or '
        '"allow_inexact": true (plan the nearest)' in body["detail"]
    )
    response = client.post(
        "/v1/plan",
        json={
            "memory_model": {"fixed_bytes": 50 * GiB, "bytes_per_sample": GiB},
            "device": {"capacity_bytes": 40 * GiB},
            "effective_batch_size": 8,
        },
    )
    assert "at micro-batch size 1" in problem(response, 422, "no-feasible-plan")["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_micro_batch_size": 0, "effective_batch_size": 8}, "body.max_micro_batch_size"),
        ({"max_micro_batch_size": -3, "effective_batch_size": 8}, "body.max_micro_batch_size"),
        (
            {"max_micro_batch_size": 8, "effective_batch_size": 2**31 + 1},
            "body.effective_batch_size",
        ),
        (
            {"max_micro_batch_size": 8, "effective_batch_size": 8, "world_size": 65537},
            "body.world_size",
        ),
        ({"max_micro_batch_size": 8, "effective_batch_size": "8"}, "body.effective_batch_size"),
        ({"max_micro_batch_size": 8.5, "effective_batch_size": 8}, "body.max_micro_batch_size"),
        ({"max_micro_batch_size": True, "effective_batch_size": 8}, "body.max_micro_batch_size"),
        ({"max_micro_batch_size": 8}, "body.effective_batch_size"),
        ({"max_micro_batch_size": 8, "effective_batch_size": 8, "bogus": 1}, "body.bogus"),
        ({"effective_batch_size": 8}, "body"),
        ({"max_micro_batch_size": 8, "profile_id": "ab", "effective_batch_size": 8}, "body"),
        (
            {
                "memory_model": {"fixed_bytes": 0, "bytes_per_sample": 0},
                "effective_batch_size": 8,
                "device": {"capacity_bytes": GiB},
            },
            "body.memory_model.bytes_per_sample",
        ),
        (
            {
                "memory_model": {"fixed_bytes": 0, "bytes_per_sample": 1},
                "effective_batch_size": 8,
                "device": {"capacity_bytes": 2**61},
            },
            "body.device.capacity_bytes",
        ),
        (
            {
                "memory_model": {"fixed_bytes": 0, "bytes_per_sample": 1},
                "effective_batch_size": 8,
                "device": {"capacity_bytes": 1, "cuda_index": 0},
            },
            "body.device",
        ),
        (
            {"max_micro_batch_size": 8, "effective_batch_size": 8, "device": {"capacity_bytes": 1}},
            "body.device",
        ),
        (
            {"memory_model": {"fixed_bytes": 0, "bytes_per_sample": 1}, "effective_batch_size": 8},
            "body.device",
        ),
        (
            {"max_micro_batch_size": 8, "effective_batch_size": 8, "world_sizes": []},
            "body.world_sizes",
        ),
        (
            {"max_micro_batch_size": 8, "effective_batch_size": 8, "safety_margin": 1.0},
            "body.safety_margin",
        ),
    ],
)
def test_plan_bad_input_is_422_with_the_field(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/plan", json=body)
    assert field in fields(problem(response, 422, "validation"))


def test_plan_malformed_json_is_400(client: TestClient) -> None:
    response = client.post(
        "/v1/plan",
        content=b'{"effective_batch_size": ',
        headers={"Content-Type": "application/json"},
    )
    body = problem(response, 400, "malformed-json")
    assert body["errors"][0]["field"] == "body"
    assert "malformed JSON at character" in body["errors"][0]["reason"]


@pytest.mark.parametrize(
    ("content", "status", "slug", "detail"),
    [
        (b"", 422, "validation", "body: the request body is empty; send a JSON object"),
        (b"[8]", 422, "validation", "body: Input should be a JSON object, not an array"),
        (b'{"a": "\xff"}', 400, "malformed-json", "the request body is not valid JSON: not UTF"),
        (b"[" * 5000 + b"]" * 5000, 400, "malformed-json", "the request body is not valid JSON"),
    ],
)
def test_plan_body_that_is_not_a_json_object_is_a_problem(
    client: TestClient, content: bytes, status: int, slug: str, detail: str
) -> None:
    """The route reads its own body (service.web.routing.read_json_body) and answers as FastAPI
    answers for a declared body: empty, not an object, not text, nested past the limit."""
    response = client.post(
        "/v1/plan", content=content, headers={"Content-Type": "application/json"}
    )
    assert problem(response, status, slug)["detail"].startswith(detail)


@pytest.mark.parametrize(
    ("content", "status", "expected"),
    [
        # Texts pydantic-core's parser refuses but json.loads takes: json decides.
        (b'\xef\xbb\xbf{"max_micro_batch_size": 8, "effective_batch_size": 16}', 200, 8),
        ('{"max_micro_batch_size": 8, "effective_batch_size": 16}'.encode("utf-16"), 200, 8),
        (b"[" * 300 + b"]" * 300, 422, "body: Input should be a JSON object, not an array"),
        (b'{"model_fingerprint": "\\ud800", "effective_batch_size": 16}', 422, "body.model_fi"),
        # Texts both take, read alike: the last of repeated keys wins.
        (
            b'{"max_micro_batch_size": 8, "max_micro_batch_size": 4, "effective_batch_size": 16}',
            200,
            4,
        ),
    ],
)
def test_plan_body_reads_as_json_loads_reads_it(
    client: TestClient, content: bytes, status: int, expected: int | str
) -> None:
    """read_json_body parses with pydantic-core first and falls back to json.loads where that
    refuses: what is accepted, and how, stays json's (as for FastAPI's declared bodies)."""
    response = client.post(
        "/v1/plan", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json()["plan"]["micro_batch_size"] == expected
    else:
        assert str(expected) in problem(response, status, "validation")["detail"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_post_without_json_content_type_is_415(
    client: TestClient, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post(
        "/v1/plan",
        content=b'{"max_micro_batch_size": 8, "effective_batch_size": 8}',
        headers=headers,
    )
    body = problem(response, 415, "unsupported-media-type")
    assert "application/json" in body["detail"]


def test_body_over_the_limit_is_413(make_app: Callable[..., FastAPI]) -> None:
    client = TestClient(make_app(max_body_bytes=4096))
    response = client.post(
        "/v1/plan", json={"max_micro_batch_size": 8, "effective_batch_size": 8, "pad": "x" * 5000}
    )
    assert "4096 bytes" in problem(response, 413, "body-too-large")["detail"]

    def chunks() -> Any:
        yield b'{"max_micro_batch_size": 8, "effective_batch_size": 8, "pad": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = client.post(
        "/v1/plan", content=chunks(), headers={"Content-Type": "application/json"}
    )
    problem(response, 413, "body-too-large")


def call_asgi(
    app: FastAPI, method: str, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[int, bytes]:
    """One request straight through the ASGI app, the body in ``chunks`` (as a server that
    received ``Transfer-Encoding: chunked`` would deliver it). (status, body)."""
    pending = list(chunks)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if not pending:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        # HTTP/1.1 requires a Host; a tokenless server on loopback answers only loopback names
        "headers": headers
        if any(k == b"host" for k, _ in headers)
        else [
            (b"host", b"127.0.0.1"),
            *headers,
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


def test_plan_reads_a_body_that_comes_in_several_messages(
    make_app: Callable[..., FastAPI],
) -> None:
    # A server hands on a long body in pieces (more_body); the route reads them all.
    text = b'{"max_micro_batch_size": 8, "effective_batch_size": 48, "world_size": 2}'
    length = str(len(text)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    status, body = call_asgi(
        make_app(), "POST", "/v1/plan", headers, [text[:10], text[10:40], text[40:]]
    )
    assert status == 200, body
    assert json.loads(body)["plan"]["micro_batch_sizes"] == [8, 8, 8]


def test_a_length_beside_chunked_framing_does_not_skip_the_size_limit(
    make_app: Callable[..., FastAPI],
) -> None:
    # h11 hands on a chunked body even when a Content-Length header came with it: the length
    # then says nothing about the body, which must be counted.
    app = make_app(max_body_bytes=4096)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"10"),
        (b"transfer-encoding", b"chunked"),
    ]
    status, body = call_asgi(app, "POST", "/v1/plan", headers, [b'{"pad": "', b"x" * 9000, b'"}'])
    assert status == 413 and b"body-too-large" in body
    small = [b'{"max_micro_batch_size": 8, ', b'"effective_batch_size": 8}']
    assert call_asgi(app, "POST", "/v1/plan", headers, small)[0] == 200


def test_odd_methods_share_one_metrics_label(make_app: Callable[..., FastAPI]) -> None:
    app = make_app()
    for method in ("FOO", "BAR", "QUUX"):  # h11 accepts any token as a method
        assert call_asgi(app, method, "/healthz", [], [b""])[0] == 405
    text = TestClient(app).get("/metrics").text
    assert 'method="other",route="/healthz",status="405"} 3.0' in text
    assert "FOO" not in text and "QUUX" not in text


def test_unknown_route_and_method_are_problems(client: TestClient) -> None:
    problem(client.get("/v1/nothing"), 404, "not-found")
    response = client.get("/v1/plan")
    problem(response, 405, "method-not-allowed")
    assert response.headers["allow"] == "POST"  # RFC 9110: a 405 lists what is allowed
    response = client.put("/v1/profiles/abc", json={})
    problem(response, 405, "method-not-allowed")
    assert response.headers["allow"] == "GET, DELETE"


# -- profiles ----------------------------------------------------------------------------------


def test_profiles_crud(client: TestClient) -> None:
    profile = make_profile()
    response = client.post("/v1/profiles", json=profile.to_dict())
    assert response.status_code == 201
    profile_id = response.json()["id"]
    assert response.headers["location"] == f"/v1/profiles/{profile_id}"
    assert Profile.from_dict(response.json()["profile"]) == profile
    got = client.get(f"/v1/profiles/{profile_id}").json()
    assert Profile.from_dict(got["profile"]) == profile
    other = client.post("/v1/profiles", json=make_profile(model_fingerprint="fp-bert").to_dict())
    listed = client.get("/v1/profiles").json()["profiles"]
    assert [row["id"] for row in listed] == [other.json()["id"], profile_id]
    only = client.get("/v1/profiles", params={"model_fingerprint": "fp-gpt2"}).json()
    assert [row["id"] for row in only["profiles"]] == [profile_id]
    assert client.delete(f"/v1/profiles/{profile_id}").status_code == 204
    for response in (
        client.get(f"/v1/profiles/{profile_id}"),
        client.delete(f"/v1/profiles/{profile_id}"),
    ):
        body = problem(response, 404, "unknown-profile")
        assert fields(body) == ["path.profile_id"]
        assert body["detail"] == f"no profile with id {profile_id!r}"  # no file path


def test_a_registered_profile_without_a_time_gets_the_service_s(client: TestClient) -> None:
    response = client.post("/v1/profiles", json=make_profile(created_at="").to_dict())
    stamped = response.json()["profile"]["created_at"]
    assert stamped.startswith("20") and stamped.endswith("+00:00")
    assert client.get(response.headers["location"]).json()["profile"]["created_at"] == stamped


def test_a_profile_with_more_capacity_than_memory_is_422(client: TestClient) -> None:
    data = {**make_profile().to_dict(), "capacity_bytes": 96 * GiB, "total_memory_bytes": 24 * GiB}
    body = problem(client.post("/v1/profiles", json=data), 422, "invalid-config")
    assert "capacity_bytes 103079215104 must be in 0..total_memory_bytes" in body["detail"]


def test_profiles_list_limit_is_bounded(client: TestClient) -> None:
    body = problem(client.get("/v1/profiles", params={"limit": 0}), 422, "validation")
    assert fields(body) == ["query.limit"]


@pytest.mark.parametrize(
    ("changes", "status", "slug"),
    [
        ({"recommended_micro_batch_size": 50}, 422, "invalid-config"),
        ({"max_micro_batch_size": 0}, 422, "validation"),
        ({"safety_margin": 1.5}, 422, "validation"),
        ({"schema_version": 99}, 422, "validation"),
        ({"device_name": "\ud800"}, 422, "validation"),
        ({"method": "magic"}, 422, "validation"),
    ],
)
def test_profiles_invalid_are_rejected(
    client: TestClient, changes: dict[str, Any], status: int, slug: str
) -> None:
    data = make_profile().to_dict()
    data.update(changes)
    content = json.dumps(data).encode()  # ASCII escapes, so a lone surrogate can be sent
    response = client.post(
        "/v1/profiles", content=content, headers={"Content-Type": "application/json"}
    )
    problem(response, status, slug)


# -- auth --------------------------------------------------------------------------------------


def test_token_guards_v1_but_not_health(make_app: Callable[..., FastAPI]) -> None:
    client = TestClient(make_app(api_token="s3cret"))
    body = {"max_micro_batch_size": 8, "effective_batch_size": 8}
    response = client.post("/v1/plan", json=body)
    assert problem(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == "Bearer"
    wrong = client.get("/v1/devices", headers={"Authorization": "Bearer s3cre"})
    problem(wrong, 401, "unauthorized")
    ok = client.post("/v1/plan", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 200


def test_token_guards_every_v1_route_before_reading_the_body(
    make_app: Callable[..., FastAPI],
) -> None:
    app = make_app(api_token="s3cret", max_body_bytes=4096)
    client = TestClient(app)
    v1 = [
        (method.upper(), path.replace("{profile_id}", "x").replace("{probe_id}", "x"))
        for path, operations in app.openapi()["paths"].items()
        if path.startswith("/v1")
        for method in operations
    ]
    assert len(v1) >= 8
    for method, path in [*v1, ("GET", "/v1/nothing-here")]:
        response = client.request(method, path, content=b"{}", headers={"Content-Type": "x/y"})
        problem(response, 401, "unauthorized")  # not 404, 405, 413 or 415: nothing leaks
    big = client.post("/v1/plan", content=b"x" * 10_000, headers={"Content-Type": "text/plain"})
    problem(big, 401, "unauthorized")


def test_token_guards_v1_under_a_mount_and_a_root_path(make_app: Callable[..., FastAPI]) -> None:
    # Behind a proxy prefix (uvicorn --root-path) or mounted in a bigger app, scope["path"]
    # still carries the prefix; the gate must match what the router matches.
    outer = FastAPI()
    outer.mount("/autobatch", make_app(api_token="s3cret"))
    client = TestClient(outer)
    body = {"max_micro_batch_size": 8, "effective_batch_size": 8}
    problem(client.post("/autobatch/v1/plan", json=body), 401, "unauthorized")
    problem(client.get("/autobatch/v1/profiles"), 401, "unauthorized")
    good = client.post("/autobatch/v1/plan", json=body, headers={"Authorization": "Bearer s3cret"})
    assert good.status_code == 200
    assert client.get("/autobatch/healthz").status_code == 200
    proxied = TestClient(make_app(api_token="s3cret"), root_path="/autobatch")
    problem(proxied.post("/autobatch/v1/plan", json=body), 401, "unauthorized")


def test_two_authorization_headers_are_refused(make_app: Callable[..., FastAPI]) -> None:
    app = make_app(api_token="s3cret")
    one = [(b"authorization", b"Bearer s3cret")]
    assert call_asgi(app, "GET", "/v1/profiles", one, [b""])[0] == 200
    for second in (b"Bearer s3cret", b"Bearer wrong"):
        headers = [(b"authorization", b"Bearer wrong"), (b"authorization", second)]
        assert call_asgi(app, "GET", "/v1/profiles", headers[::-1], [b""])[0] == 401
        assert call_asgi(app, "GET", "/v1/profiles", headers, [b""])[0] == 401


@pytest.mark.parametrize("token", ["", "  "])
def test_an_empty_token_is_refused_at_start(make_app: Callable[..., FastAPI], token: str) -> None:
    with pytest.raises(ValidationError, match="API token is empty"):
        make_app(api_token=token)


@pytest.mark.parametrize(
    ("authorization", "matches"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("Bearer  s3cret ", True),
        ("Bearer s3cret2", False),
        ("Basic s3cret", False),
        ("s3cret", False),
        ("Bearer ", False),
        (None, False),
        ("Bearer s3crét", False),
    ],
)
def test_token_matches(authorization: str | None, matches: bool) -> None:
    assert token_matches(authorization, b"s3cret") is matches


@pytest.mark.parametrize(
    ("content_type", "is_json"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/merge-patch+json", True),
        ("application/jsonx", False),
        ("text/json", False),
        ("text/plain", False),
        ("", False),
        (None, False),
    ],
)
def test_is_json_media_type(content_type: str | None, is_json: bool) -> None:
    assert is_json_media_type(content_type) is is_json


# -- probes ------------------------------------------------------------------------------------


def test_a_probe_on_a_gpu_this_node_lacks_is_422_at_once(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    client = TestClient(make_app(config_file=registry_file))  # two fake GPUs: cuda 0 and 1
    body = problem(
        client.post("/v1/probes", json={"model": "tiny-mlp", "device": "cuda:5"}),
        422,
        "unknown-device",
    )
    assert fields(body) == ["body.device"] and "visible: [0, 1]" in body["detail"]
    no_gpu = TestClient(make_app(config_file=registry_file, nvml=no_nvml()))
    body = problem(
        no_gpu.post("/v1/probes", json={"model": "tiny-mlp", "device": "cuda:0"}),
        422,
        "unknown-device",
    )
    assert "no usable GPU" in body["detail"] and "driver is not loaded" in body["detail"]
    # In the request's fields, never the CLI's flag or Python's keyword, and no "))" of one
    # parenthesis inside another.
    assert body["detail"].endswith(
        'give "device" a device this node has: "cpu", or "sim:16GiB" (a simulated card)'
    )
    assert "--device" not in body["detail"] and "device=" not in body["detail"]
    assert "))" not in body["detail"]
    assert client.get("/v1/probes").json()["probes"] == []  # nothing was queued


@pytest.mark.parametrize("device", ["sim:0", "gpu:0", "cuda:x"])
def test_a_device_the_library_cannot_parse_is_422(
    make_app: Callable[..., FastAPI], registry_file: Path, device: str
) -> None:
    client = TestClient(make_app(config_file=registry_file))
    response = client.post("/v1/probes", json={"model": "tiny-mlp", "device": device})
    assert fields(problem(response, 422, "validation")) == ["body.device"]
    assert client.get("/v1/probes").json()["probes"] == []


def test_probing_without_a_registry_says_how_to_give_one(client: TestClient) -> None:
    body = problem(client.post("/v1/probes", json={"model": "tiny-mlp"}), 404, "unknown-model")
    assert "started without --config-file" in body["detail"]


def test_probe_of_an_unregistered_model_is_404(client: TestClient) -> None:
    response = client.post("/v1/probes", json={"model": "os:system"})
    problem(response, 422, "validation")  # not even a valid name
    response = client.post("/v1/probes", json={"model": "resnet"})
    body = problem(response, 404, "unknown-model")
    assert fields(body) == ["body.model"]
    problem(client.get("/v1/probes/abc"), 404, "unknown-job")


def wait_for(client: TestClient, probe_id: str, statuses: set[str], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/probes/{probe_id}").json()
        if body["status"] in statuses or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("device", "key"),
    [
        ("cuda:0", "cuda:0"),
        ("cuda:00", "cuda:0"),
        ("cuda:12", "cuda:12"),
        ("cpu", "host"),
        ("sim:64MiB", "host"),
        ("sim:1 GiB", "host"),
    ],
)
def test_queue_key_is_one_per_gpu_and_one_for_the_host(device: str, key: str) -> None:
    assert queue_key(device) == key


@pytest.mark.slow  # spawned probe children
def test_a_running_probe_always_shows_its_child_pid(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    # Polled without pause: the child takes ~1 s to spawn, so a run marked "running" before
    # its pid was known would be seen here (it was, once, in CI).
    app = make_app(config_file=registry_file, probe_timeout_seconds=2)
    runs = app.state.service.runs
    run = runs.submit("slow-mlp")
    seen: list[tuple[str, int | None]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        current = runs.get(run.id)
        seen.append((current.status, current.child_pid))
        if current.status in ("succeeded", "failed"):
            break
    statuses = [status for status, _ in seen]
    assert "running" in statuses and statuses[-1] == "failed"
    assert all(pid is not None for status, pid in seen if status == "running")
    assert all(pid is None for status, pid in seen if status != "running")


@pytest.mark.slow  # spawned probe children
def test_probe_queue_per_device_timeout_and_409(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    client = TestClient(
        make_app(config_file=registry_file, probe_timeout_seconds=2, max_queued_probes=1)
    )
    first = client.post("/v1/probes", json={"model": "slow-mlp"})
    assert first.status_code == 202
    assert first.headers["location"] == f"/v1/probes/{first.json()['id']}"
    running = wait_for(client, first.json()["id"], {"running"})
    assert running["child_pid"] is not None
    second = client.post("/v1/probes", json={"model": "slow-mlp"})
    assert (second.json()["status"], second.json()["queue_position"]) == ("queued", 0)
    problem(client.post("/v1/probes", json={"model": "slow-mlp"}), 409, "queue-full")
    # Another simulated size is the same host: the same queue, not a way around it.
    other = client.post("/v1/probes", json={"model": "slow-mlp", "device": "sim:16 MiB"})
    problem(other, 409, "queue-full")
    failed = wait_for(client, first.json()["id"], {"succeeded", "failed"})
    assert failed["status"] == "failed"
    assert "timed out after 2 s" in failed["error"]
    assert failed["child_pid"] is None
    # The queued job runs next (and times out too); the service keeps answering.
    assert wait_for(client, second.json()["id"], {"failed"})["status"] == "failed"
    assert client.get("/healthz").status_code == 200
    listed = client.get("/v1/probes").json()["probes"]
    assert [p["id"] for p in listed] == [second.json()["id"], first.json()["id"]]
    assert 'autobatch_probe_jobs_total{event="failed"} 2.0' in client.get("/metrics").text


@pytest.mark.slow  # three spawned children, each importing torch
def test_a_second_probe_job_answers_from_the_store_unless_refresh(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    app = make_app(config_file=registry_file)
    client, store = TestClient(app), app.state.service.store
    first = wait_for(
        client,
        client.post("/v1/probes", json={"model": "tiny-mlp"}).json()["id"],
        {"succeeded", "failed"},
    )
    assert first["status"] == "succeeded", first["error"]
    assert not first["cached"] and first["progress"]["num_trials"] >= 2
    again = wait_for(
        client,
        client.post("/v1/probes", json={"model": "tiny-mlp"}).json()["id"],
        {"succeeded", "failed"},
    )
    assert again["status"] == "succeeded", again["error"]
    assert again["cached"] and again["progress"]["num_trials"] == 0  # no step ran
    assert again["profile_id"] == first["profile_id"] and again["profile"] == first["profile"]
    assert len(store.list_profiles()) == 1  # no duplicate stored
    fresh = wait_for(
        client,
        client.post("/v1/probes", json={"model": "tiny-mlp", "refresh": True}).json()["id"],
        {"succeeded", "failed"},
    )
    assert fresh["status"] == "succeeded", fresh["error"]
    assert not fresh["cached"] and fresh["progress"]["num_trials"] >= 2
    assert fresh["profile_id"] != first["profile_id"]
    assert len(store.list_profiles()) == 2


# -- OpenAPI -----------------------------------------------------------------------------------


def test_openapi_documents_problems(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {
        "/v1/plan",
        "/v1/profiles",
        "/v1/profiles/{profile_id}",
        "/v1/probes",
        "/v1/probes/{probe_id}",
        "/v1/devices",
        "/healthz",
        "/readyz",
        "/metrics",
    } <= set(schema["paths"])
    plan_responses = schema["paths"]["/v1/plan"]["post"]["responses"]
    assert plan_responses["422"]["content"] == {
        PROBLEM: {"schema": {"$ref": "#/components/schemas/Problem"}}
    }
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert client.get("/docs").status_code == 200


def test_openapi_documents_the_plan_body_in_every_app(make_app: Callable[..., FastAPI]) -> None:
    """POST /v1/plan reads its own body; its schema still sits in components, with the nested
    models, in each app built from the shared router (the route's openapi_extra is not edited)."""
    from service.plans.schemas import PlanCreate

    for _ in range(2):
        schema = TestClient(make_app()).get("/openapi.json").json()
        body = schema["paths"]["/v1/plan"]["post"]["requestBody"]
        reference = {"$ref": "#/components/schemas/PlanCreate"}
        assert body == {"required": True, "content": {"application/json": {"schema": reference}}}
        components = schema["components"]["schemas"]
        assert set(components["PlanCreate"]["properties"]) == set(PlanCreate.model_fields)
        assert components["PlanCreate"]["required"] == ["effective_batch_size"]
        assert {"DeviceSpec", "MemoryModelBase"} <= set(components)


def test_the_profile_schema_has_every_profile_field() -> None:
    """The service must accept whatever autobatch.Profile.to_dict() produces (no drift)."""
    from service.web.schemas import (
        BudgetReadingBase,
        MemoryBudgetBase,
        ProbeTimingsFields,
        ProfileBase,
        TrialBase,
    )

    # A profile that says its memory budget and timings (a probe's): every field, nested ones too.
    timings = ProbeTimings(
        total_seconds=3.5,
        estimate_seconds=2.0,
        fake_step_seconds=(0.5, 0.75, 0.75),
        trial_seconds=(0.5, 0.5, 0.25),
        cleanup_seconds=(0.0, 0.0, 0.125),
    )
    data = make_profile(budget=given_budget(80 * GiB, gpu_fraction=0.5), timings=timings).to_dict()
    assert set(ProfileBase.model_fields) == set(data)
    assert set(ProbeTimingsFields.model_fields) == set(data["timings"])
    assert set(TrialBase.model_fields) == set(data["trials"][0])
    assert set(MemoryBudgetBase.model_fields) == set(data["budget"])
    assert set(BudgetReadingBase.model_fields) == set(data["budget"]["readings"][0])
    served = ProfileBase.model_validate_json(json.dumps(data)).model_dump()
    assert Profile.from_dict(served) == Profile.from_dict(data)
    # One without (an estimate's, or one written before budgets) leaves the key out.
    assert "budget" not in make_profile().to_dict()


def test_the_plan_schema_has_every_plan_field(client: TestClient) -> None:
    """A field of Plan missing from the response schema would be dropped from every answer."""
    import dataclasses

    from autobatch.planning._prediction import Prediction
    from service.plans.schemas import PlanFields, PredictionFields

    assert set(PlanFields.model_fields) == {f.name for f in dataclasses.fields(Plan)}
    assert set(PredictionFields.model_fields) == {f.name for f in dataclasses.fields(Prediction)}
    answer = client.post("/v1/plan", json={"max_micro_batch_size": 24, "effective_batch_size": 64})
    served = Plan.from_dict(answer.json()["plan"])
    assert served.to_dict().keys() == autobatch.plan(24, effective_batch_size=64).to_dict().keys()
    assert (served.micro_batch_size, served.gradient_accumulation_steps) == (16, 4)


def test_validator_messages_read_without_pydantics_prefix(client: TestClient) -> None:
    response = client.post("/v1/plan", json={"effective_batch_size": 8})  # no limit at all
    body = problem(response, 422, "validation")
    assert "Value error" not in body["detail"]
    assert body["errors"][0]["reason"].startswith("give exactly one of")
