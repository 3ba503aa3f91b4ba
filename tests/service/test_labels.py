"""GPU feature discovery labels through ``POST /v1/plan``: MiB or bytes, NVML over a
wrong label, MIG slices; the reading itself is tested in tests/device/test_node_labels.py."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.device.test_node_labels import MIXED
from tests.service.conftest import no_nvml

GiB = 2**30
MiB = 2**20


def plan_body(device: dict[str, Any]) -> dict[str, Any]:
    return {
        "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
        "device": device,
        "safety_margin": 0.0,
        "effective_batch_size": 8,
    }


def test_service_reads_bytes_labels_and_says_so(client: TestClient) -> None:
    labels = {"nvidia.com/gpu.memory": "42505273344"}
    body = client.post("/v1/plan", json=plan_body({"node_labels": labels})).json()
    assert body["device"]["capacity_bytes"] == 42505273344
    assert body["plan"]["max_micro_batch_size"] == 39  # not 1024 on a "41-PiB card"
    assert "read as bytes" in body["device"]["warnings"][0]


def test_service_prefers_its_nvml_over_a_wrong_label(client: TestClient) -> None:
    # The fake node has an 80 GiB A100; the label claims half of it.
    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "40960"}
    body = client.post("/v1/plan", json=plan_body({"node_labels": labels})).json()
    assert body["device"]["capacity_bytes"] == 80 * GiB
    assert "NVML reads 80.00 GiB" in body["device"]["warnings"][0]


def test_service_without_nvml_takes_the_label(make_app: Any) -> None:
    client = TestClient(make_app(nvml=no_nvml()))
    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "40960"}
    body = client.post("/v1/plan", json=plan_body({"node_labels": labels})).json()
    assert body["device"]["capacity_bytes"] == 40 * GiB
    assert body["device"]["warnings"] == []


def test_service_plans_for_a_mig_slice_and_asks_which(client: TestClient) -> None:
    body = client.post(
        "/v1/plan", json=plan_body({"node_labels": MIXED, "mig_profile": "2g.10gb"})
    ).json()
    assert body["device"]["capacity_bytes"] == 9984 * MiB
    assert body["plan"]["max_micro_batch_size"] == 9  # 9.75 GiB / 1 GiB per sample
    response = client.post("/v1/plan", json=plan_body({"node_labels": MIXED}))
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "body.device.mig_profile"
    response = client.post(
        "/v1/plan", json=plan_body({"capacity_bytes": GiB, "mig_profile": "1g.5gb"})
    )
    assert response.status_code == 422
    assert "mig_profile goes with node_labels" in response.text
