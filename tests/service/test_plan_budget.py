"""``POST /v1/plan`` plans for the memory a job really has: a declared gpu_fraction,
a vGPU limit variable, time-sliced cards, a card others use; every answer names its deciding
source and sharing mode, says what it could not see, whether the plan fits now, and how many such
plans fit on one card."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device import SHARING_TOLERANCE
from autobatch.device._budget import SHARING_MODES, SOURCES
from autobatch.device._nvml import Nvml
from autobatch.profile import MemoryModel
from service.plans.schemas import PlanPublic
from service.web.schemas import BudgetSourceName, SharingModeName
from tests.helpers.fake_pynvml import FakeGpu, FakePynvml, GiB, MiB

# A step of 2 GiB plus 0.5 GiB a sample, as a caller's memory line.
LINE = {"fixed_bytes": 2 * GiB, "bytes_per_sample": GiB // 2}


def request(device: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"memory_model": LINE, "device": device, "effective_batch_size": 64, **extra}


def answer(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    PlanPublic.model_validate(response.json())  # the answer matches its schema
    data: dict[str, Any] = response.json()
    return data


def one_card(total: int, free: int, used: int = 0) -> Nvml:
    gpu = FakeGpu(uuid="GPU-24", name="NVIDIA L4", total=total, free=free, used_v2=used)
    return Nvml(FakePynvml([gpu]), environ={})


@pytest.fixture(autouse=True)
def no_vgpu_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_DEVICE_MEMORY_LIMIT_0", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MEMORY_LIMIT", raising=False)


def test_two_trials_on_a_24_gb_card_each_plan_for_half_and_learn_that_two_fit(
    make_app: Callable[..., FastAPI],
) -> None:
    # The issue: gpu_fraction on /v1/plan was a 422; each trial planned for 24 GB (18 GB peak).
    client = TestClient(make_app(nvml=one_card(24 * GiB, 24 * GiB)))

    whole = answer(client, request({"cuda_index": 0}))["plan"]
    half = answer(client, request({"cuda_index": 0}, gpu_fraction=0.5))
    inner = answer(client, request({"cuda_index": 0, "gpu_fraction": 0.5}))

    assert whole["predicted_peak_memory_bytes"] > 12 * GiB
    assert whole["budget"]["trials_per_gpu"] == 1
    plan, device = half["plan"], half["device"]
    assert plan["capacity_bytes"] == device["capacity_bytes"] == 12 * GiB
    assert plan["predicted_peak_memory_bytes"] <= 12 * GiB * 0.95
    budget = plan["budget"]
    assert (budget["deciding_source"], budget["sharing_mode"]) == ("gpu_fraction", "fractional")
    assert (device["deciding_source"], device["sharing_mode"]) == ("gpu_fraction", "fractional")
    assert [r["source"] for r in budget["readings"]] == ["nvml", "gpu_fraction"]
    assert budget["card_memory_bytes"] == 24 * GiB
    assert budget["trials_per_gpu"] == 2  # 22.8 GiB of the card over a peak of at most 11.4
    assert inner["plan"] == plan  # device.gpu_fraction is the same thing


def test_a_fraction_of_a_given_size_or_labels(client: TestClient) -> None:
    given = answer(client, request({"capacity_bytes": 24 * GiB}, gpu_fraction=0.25))["plan"]
    assert given["capacity_bytes"] == 6 * GiB
    assert given["budget"]["unseen_sources"] == []  # the caller said what the job has
    labels = {"nvidia.com/gpu.memory": str(24 * 1024), "nvidia.com/gpu.product": "NVIDIA-L4"}
    labelled = answer(client, request({"node_labels": labels}, gpu_fraction=0.5))["plan"]
    assert labelled["capacity_bytes"] == 12 * GiB
    assert labelled["budget"]["deciding_source"] == "gpu_fraction"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"max_micro_batch_size": 8, "effective_batch_size": 16, "gpu_fraction": 0.5},
            "body.gpu_fraction",
        ),
        (request({"cuda_index": 0}, gpu_fraction=0), "body.gpu_fraction"),
        (request({"cuda_index": 0}, gpu_fraction=1.5), "body.gpu_fraction"),
        (request({"cuda_index": 0, "gpu_fraction": 0.5}, gpu_fraction=0.25), "body.gpu_fraction"),
        (
            {"memory_model": LINE, "effective_batch_size": 64, "gpu_fraction": 0.5},
            "body.gpu_fraction",
        ),
    ],
)
def test_a_fraction_that_cannot_be_planned_is_a_422_naming_it(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422, response.text
    assert "gpu_fraction" in response.json()["detail"]
    assert response.json()["errors"][0]["field"] == field


def test_a_vgpu_limit_variable_in_the_sidecar_s_environment_decides(
    make_app: Callable[..., FastAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The issue: CUDA_DEVICE_MEMORY_LIMIT_0=1024m, which vGPU device plugins set, was ignored.
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "3g")
    client = TestClient(make_app(nvml=one_card(10 * GiB, 10 * GiB)))

    plan = answer(client, request({"cuda_index": 0}, effective_batch_size=4))["plan"]

    assert plan["capacity_bytes"] == 3 * GiB
    budget = plan["budget"]
    assert (budget["deciding_source"], budget["sharing_mode"]) == ("vgpu_limit", "virtualised")
    assert budget["readings"][1]["detail"] == "CUDA_DEVICE_MEMORY_LIMIT_0='3g'"
    assert plan["predicted_peak_memory_bytes"] <= 3 * GiB


def test_a_plan_for_a_local_card_says_what_it_could_not_see(client: TestClient) -> None:
    # A sharing layer in the job's container limits its CUDA runtime, which the service never
    # reads: the budget says so, in a field and a warning, rather than vouching for the card.
    budget = answer(client, request({"cuda_index": 0}))["plan"]["budget"]
    assert budget["unseen_sources"] == ["cuda_runtime"]
    assert any("HAMi" in w and "GPU fraction" in w for w in budget["warnings"])
    assert budget["sharing_mode"] == "none" and budget["deciding_source"] == "nvml"


def test_a_card_others_use_says_in_the_plan_whether_it_fits_now(
    make_app: Callable[..., FastAPI],
) -> None:
    # The issue: a plan for the card's 80 GB while others hold 30; only a note said so.
    client = TestClient(make_app(nvml=one_card(80 * GiB, 50 * GiB, used=30 * GiB)))
    big = request({"cuda_index": 0}, effective_batch_size=256)

    total = answer(client, big)["plan"]
    free = answer(client, {**big, "device": {"cuda_index": 0, "memory": "free"}})["plan"]

    assert total["capacity_bytes"] == 80 * GiB
    assert total["predicted_peak_memory_bytes"] > 50 * GiB
    assert total["budget"]["sharing_mode"] == "shared"
    assert total["budget"]["free_now_bytes"] == 50 * GiB
    assert total["budget"]["fits_now"] is False
    assert any("fits_now is false" in w for w in total["budget"]["warnings"])
    assert free["capacity_bytes"] == 50 * GiB
    assert free["budget"]["fits_now"] is True
    assert free["budget"]["sharing_mode"] == "shared"


TIME_SLICED = {
    "nvidia.com/gpu.memory": str(80 * 1024),
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-SHARED",
    "nvidia.com/gpu.replicas": "4",
    "nvidia.com/gpu.sharing-strategy": "time-slicing",
}


def test_a_time_sliced_card_is_planned_as_its_share_not_the_whole_card(
    client: TestClient,
) -> None:
    answered = answer(client, request({"node_labels": TIME_SLICED}))
    plan, device = answered["plan"], answered["device"]

    assert plan["capacity_bytes"] == device["capacity_bytes"] == 20 * GiB
    assert (device["deciding_source"], device["sharing_mode"]) == ("time_slicing", "time_sliced")
    assert device["name"] == "NVIDIA-A100-SXM4-80GB"  # without the -SHARED the plugin adds
    assert plan["budget"]["card_memory_bytes"] == 80 * GiB
    assert plan["budget"]["trials_per_gpu"] >= 4
    assert "4 replicas" in plan["budget"]["readings"][1]["detail"]


def test_a_shared_card_without_its_replicas_is_refused_unless_the_share_is_given(
    client: TestClient,
) -> None:
    labels = {k: v for k, v in TIME_SLICED.items() if k != "nvidia.com/gpu.replicas"}

    refused = client.post("/v1/plan", json=request({"node_labels": labels}))
    overridden = answer(client, request({"node_labels": labels}, gpu_fraction=0.25))

    assert refused.status_code == 422
    assert "never planned as the whole card" in refused.text and "gpu_fraction" in refused.text
    assert overridden["plan"]["capacity_bytes"] == 20 * GiB
    bad = {**TIME_SLICED, "nvidia.com/gpu.replicas": "four"}
    assert client.post("/v1/plan", json=request({"node_labels": bad})).status_code == 422


def test_a_mig_slice_shared_by_replicas(client: TestClient) -> None:
    labels = {
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/gpu.product": "A100-SXM4-40GB",
        "nvidia.com/gpu.memory": "40537",
        "nvidia.com/mig-1g.5gb.memory": "4864",
        "nvidia.com/mig-1g.5gb.replicas": "2",
    }
    plan = answer(
        client,
        {
            "memory_model": {"fixed_bytes": 0, "bytes_per_sample": 64 * MiB},
            "device": {"node_labels": labels, "mig_profile": "1g.5gb"},
            "effective_batch_size": 64,
        },
    )["plan"]
    assert plan["capacity_bytes"] == 4864 * MiB // 2


def test_the_schema_s_names_are_the_library_s() -> None:
    assert set(BudgetSourceName.__args__) == set(SOURCES)  # type: ignore[attr-defined]
    assert set(SharingModeName.__args__) == set(SHARING_MODES)  # type: ignore[attr-defined]
    assert 0 < SHARING_TOLERANCE < 0.1


def test_the_python_client_sends_a_fraction_and_reads_the_budget_back(
    make_app: Callable[..., FastAPI],
) -> None:
    from tests.service.test_client import client_for

    api = client_for(make_app(nvml=one_card(24 * GiB, 24 * GiB)))
    line = MemoryModel(fixed_bytes=2 * GiB, bytes_per_sample=GiB // 2)

    planned = api.plan(memory_model=line, cuda_index=0, gpu_fraction=0.5, effective_batch_size=64)
    rows = api.plan_world_sizes(
        memory_model=line,
        cuda_index=0,
        gpu_fraction=0.5,
        effective_batch_size=64,
        world_sizes=[1, 2],
    )

    assert planned.capacity_bytes == 12 * GiB
    assert planned.budget is not None
    assert (planned.budget.deciding_source, planned.budget.sharing_mode) == (
        "gpu_fraction",
        "fractional",
    )
    assert planned.budget.trials_per_gpu == 2
    assert [row.plan.budget.trials_per_gpu for row in rows if row.plan and row.plan.budget] == [
        2,
        2,
    ]
