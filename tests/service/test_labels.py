"""GPU feature discovery labels: MiB or bytes, NVML over a wrong label, MIG slices (issue 12)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from autobatch.device import GpuInfo, MemoryInfo
from service.labels import LabelError, read_node_labels
from tests.service.conftest import no_nvml

GiB = 2**30
MiB = 2**20
A100_40 = "NVIDIA A100-SXM4-40GB"
# GFD's labels on a 40 GB A100 under the mixed MIG strategy (values as GFD writes them).
MIXED = {
    "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/gpu.product": "A100-SXM4-40GB",
    "nvidia.com/gpu.memory": "40537",
    "nvidia.com/mig-1g.5gb.count": "4",
    "nvidia.com/mig-1g.5gb.memory": "4864",
    "nvidia.com/mig-2g.10gb.count": "2",
    "nvidia.com/mig-2g.10gb.memory": "9984",
}


def gpu(name: str, total_bytes: int, *, is_mig: bool = False) -> GpuInfo:
    memory = MemoryInfo(
        total_memory_bytes=total_bytes, free_memory_bytes=total_bytes, used_memory_bytes=0
    )
    return GpuInfo(
        nvml_index=0, cuda_index=0, uuid="GPU-x", name=name, memory=memory, is_mig=is_mig
    )


def test_mib_is_mib() -> None:
    device = read_node_labels({"nvidia.com/gpu.memory": "40537"}, mig_profile=None, gpus=[])
    assert device.capacity_bytes == 40537 * MiB
    assert device.warnings == ()


def test_a_value_that_can_only_be_bytes_is_read_as_bytes_with_a_warning() -> None:
    # Some GFD versions wrote bytes: as MiB, 42505273344 would be a 39.6-PiB card.
    device = read_node_labels({"nvidia.com/gpu.memory": "42505273344"}, mig_profile=None, gpus=[])
    assert device.capacity_bytes == 42505273344
    assert len(device.warnings) == 1
    assert "read as bytes" in device.warnings[0] and "42505273344" in device.warnings[0]


def test_a_value_neither_mib_nor_bytes_is_refused() -> None:
    with pytest.raises(LabelError, match="neither MiB") as caught:
        read_node_labels({"nvidia.com/gpu.memory": str(2**51)}, mig_profile=None, gpus=[])
    assert caught.value.field == "body.device.node_labels.nvidia.com/gpu.memory"


@pytest.mark.parametrize(
    ("label_mib", "nvml_bytes", "expected", "num_warnings"),
    [
        ("20268", 40 * GiB, 40 * GiB, 1),  # half the card: NVML wins
        ("40537", 40 * GiB, 40537 * MiB, 0),  # 1% apart: the label stands
        ("39000", 40 * GiB, 39000 * MiB, 0),  # 4.8% apart: still the label
        ("38000", 40 * GiB, 40 * GiB, 1),  # 7.2% apart: NVML
    ],
)
def test_nvml_wins_when_it_sees_the_card_and_disagrees_by_over_5_percent(
    label_mib: str, nvml_bytes: int, expected: int, num_warnings: int
) -> None:
    labels = {"nvidia.com/gpu.product": "A100-SXM4-40GB", "nvidia.com/gpu.memory": label_mib}
    device = read_node_labels(labels, mig_profile=None, gpus=[gpu(A100_40, nvml_bytes)])
    assert device.capacity_bytes == expected
    assert len(device.warnings) == num_warnings


def test_nvml_of_another_card_or_of_a_slice_does_not_override_the_label() -> None:
    labels = {"nvidia.com/gpu.product": "A100-SXM4-40GB", "nvidia.com/gpu.memory": "20268"}
    others = [gpu("NVIDIA H100 NVL", 94 * GiB), gpu(f"{A100_40} MIG 1g.5gb", 5 * GiB, is_mig=True)]
    device = read_node_labels(labels, mig_profile=None, gpus=others)
    assert device.capacity_bytes == 20268 * MiB


def test_a_mixed_mig_node_plans_for_the_slice() -> None:
    device = read_node_labels(MIXED, mig_profile="1g.5gb", gpus=[gpu(A100_40, 40 * GiB)])
    assert device.capacity_bytes == 4864 * MiB  # the slice, not the 40 GB card
    assert device.name == "A100-SXM4-40GB-MIG-1g.5gb"
    seen = [gpu(f"{A100_40} MIG 1g.5gb", 10 * GiB, is_mig=True)]  # NVML disagrees on the slice
    assert read_node_labels(MIXED, mig_profile="1g.5gb", gpus=seen).capacity_bytes == 10 * GiB


@pytest.mark.parametrize(
    ("mig_profile", "pattern"),
    [
        (None, r"shows MIG slices \(mixed strategy\): 1g\.5gb \(4864 MiB\), 2g\.10gb \(9984 MiB\)"),
        ("3g.20gb", "'3g.20gb' is not among the node's MIG slices"),
    ],
)
def test_a_mixed_mig_node_needs_a_known_slice(mig_profile: str | None, pattern: str) -> None:
    with pytest.raises(LabelError, match=pattern) as caught:
        read_node_labels(MIXED, mig_profile=mig_profile, gpus=[])
    assert caught.value.field == "body.device.mig_profile"


# -- through the service ----------------------------------------------------------------------


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
