"""The sidecar on a real GPU node, NVML faked at the pynvml boundary: a hung or lost GPU never
freezes the service, the container's own GPUs are the ones planned for, MIG and unreadable cards
break nothing, and the answers say where their numbers came from."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device._nvml import Nvml
from tests.helpers.fake_pynvml import ERROR_CLASSES, FakeGpu, FakePynvml, GiB, MiB
from tests.service.conftest import A100_UUID, H100_UUID, two_gpus

PROBLEM = "application/problem+json"
NVML_FREE_PLAN = {"max_micro_batch_size": 8, "effective_batch_size": 16}


def local_plan(device: dict[str, Any]) -> dict[str, Any]:
    return {
        "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
        "device": device,
        "effective_batch_size": 8,
    }


def problem_type(response: Any) -> str:
    assert response.headers["content-type"] == PROBLEM, response.text
    return str(response.json()["type"]).removeprefix("urn:autobatch:problem:")


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """A hung driver: memory queries block until set. Set after 30 s at the latest, so an
    implementation that waits on NVML fails its assertions instead of hanging the suite."""
    event = threading.Event()
    timer = threading.Timer(30, event.set)
    timer.start()
    yield event
    event.set()
    timer.cancel()


# -- NVML off the event loop -------------------------------------------------------------------


def test_a_hung_memory_query_answers_503_and_blocks_nothing_else(
    make_app: Callable[..., FastAPI], gate: threading.Event
) -> None:
    gpus = two_gpus()
    gpus[0].memory_gate = gate
    fake = FakePynvml(gpus)
    client = TestClient(make_app(nvml=Nvml(fake, environ={}), nvml_timeout_seconds=0.2))

    hung = client.post("/v1/plan", json=local_plan({"cuda_index": 0}))
    assert hung.status_code == 503 and problem_type(hung) == "nvml_timeout"
    assert "did not answer within the timeout" in hung.json()["detail"]
    assert hung.headers["retry-after"] == "5"
    # Everything else answers while the call is still stuck in the driver:
    assert client.get("/healthz").status_code == 200
    assert client.post("/v1/plan", json=NVML_FREE_PLAN).status_code == 200
    assert client.post("/v1/plan", json=local_plan({"cuda_index": 1})).status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert [(p["uuid"], p["reason"]) for p in ready.json()["gpu_problems"]] == [
        (A100_UUID, "nvml_timeout")
    ]
    devices = client.get("/v1/devices").json()["devices"]
    assert [(d["uuid"], d["memory_reason"]) for d in devices] == [
        (A100_UUID, "nvml_timeout"),
        (H100_UUID, None),
    ]
    assert "autobatch_gpu_memory_total_bytes" in client.get("/metrics").text
    for _ in range(3):
        assert client.post("/v1/plan", json=local_plan({"cuda_index": 0})).status_code == 503
    # One call in flight per device, never one per request:
    assert [call for call in fake.memory_calls if call[0] == A100_UUID] == [
        (A100_UUID, fake.nvmlMemory_v2)
    ]

    gate.set()  # the driver answers again: recovered without a restart
    for _ in range(100):
        recovered = client.post("/v1/plan", json=local_plan({"cuda_index": 0}))
        if recovered.status_code == 200:
            break
        threading.Event().wait(0.05)
    assert recovered.status_code == 200
    assert recovered.json()["device"]["capacity_bytes"] == 80 * GiB
    assert client.get("/readyz").status_code == 200


def test_a_lost_gpu_answers_503_gpu_lost_and_readyz_says_so(
    make_app: Callable[..., FastAPI],
) -> None:
    gpus = two_gpus()
    gpus[0].memory_v2_error = ERROR_CLASSES["NVMLError_GpuIsLost"]
    client = TestClient(make_app(nvml=Nvml(FakePynvml(gpus), environ={})))

    lost = client.post("/v1/plan", json=local_plan({"cuda_index": 0}))
    assert lost.status_code == 503 and problem_type(lost) == "gpu_lost"
    assert "drain the node" in lost.json()["detail"]
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["gpu_problems"][0]["reason"] == "gpu_lost"
    assert client.post("/v1/plan", json=local_plan({"cuda_index": 1})).status_code == 200

    gpus[0].memory_v2_error = None  # reset by the operator: ready again, no restart
    assert client.get("/readyz").status_code == 200


def test_readings_say_when_they_were_sampled(client: TestClient) -> None:
    device = client.get("/v1/devices").json()["devices"][0]
    assert device["sampled_at"] > 1.7e9 and 0 <= device["age_seconds"] < 60
    plan = client.post("/v1/plan", json=local_plan({"cuda_index": 0})).json()
    assert plan["device"]["sampled_at"] > 1.7e9
    assert plan["device"]["memory_source"] == "nvml"


# -- the container's own GPUs ------------------------------------------------------------------


def test_the_pods_own_card_is_planned_for_in_a_privileged_pod(
    make_app: Callable[..., FastAPI],
) -> None:
    nvml = Nvml(FakePynvml(two_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": H100_UUID})
    client = TestClient(make_app(nvml=nvml))

    body = client.get("/v1/devices").json()
    assert [(d["uuid"], d["cuda_index"], d["given"]) for d in body["devices"]] == [
        (A100_UUID, None, False),
        (H100_UUID, 0, True),
    ]
    assert "not given" in body["note"] and "never planned on" in body["note"]
    plan = client.post("/v1/plan", json=local_plan({"cuda_index": 0, "memory": "free"})).json()
    assert (plan["device"]["uuid"], plan["device"]["capacity_bytes"]) == (H100_UUID, 90 * GiB)
    other = client.post("/v1/plan", json=local_plan({"uuid": A100_UUID}))
    assert other.status_code == 422 and problem_type(other) == "unknown-device"
    assert "this container was not given it" in other.json()["detail"]


def test_a_pod_given_no_gpu_plans_on_none(make_app: Callable[..., FastAPI]) -> None:
    nvml = Nvml(FakePynvml(two_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": "none"})
    client = TestClient(make_app(nvml=nvml, require_gpu=True))

    response = client.post("/v1/plan", json=local_plan({"cuda_index": 0}))
    assert response.status_code == 422 and problem_type(response) == "unknown-device"
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["num_gpus"] == 0


def test_a_sidecar_sharing_a_dra_claim_plans_on_the_claims_gpu(
    make_app: Callable[..., FastAPI],
) -> None:
    """deploy/training-pod.yaml: the claim's card is injected through CDI, which sets
    NVIDIA_VISIBLE_DEVICES=void; NVML in the sidecar sees that card only, and plans on it."""
    gpu = two_gpus()[1]
    nvml = Nvml(FakePynvml([gpu]), environ={"NVIDIA_VISIBLE_DEVICES": "void"})
    client = TestClient(make_app(nvml=nvml, require_gpu=True))

    plan = client.post("/v1/plan", json=local_plan({"cuda_index": 0, "memory": "free"}))
    assert plan.status_code == 200, plan.text
    assert (plan.json()["device"]["uuid"], plan.json()["device"]["capacity_bytes"]) == (
        H100_UUID,
        90 * GiB,
    )
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["num_gpus"] == 1


def test_cuda_device_order_decides_cuda_index_on_a_mixed_node(
    make_app: Callable[..., FastAPI],
) -> None:
    gpus = [
        FakeGpu(
            uuid="GPU-l4",
            name="NVIDIA L4",
            total=24 * GiB,
            free=24 * GiB,
            num_cores=7424,
            max_sm_clock_mhz=2040,
        ),
        FakeGpu(
            uuid="GPU-h100",
            name="NVIDIA H100 80GB HBM3",
            total=80 * GiB,
            free=80 * GiB,
            num_cores=16896,
            max_sm_clock_mhz=1980,
        ),
    ]
    fastest = TestClient(make_app(nvml=Nvml(FakePynvml(gpus), environ={})))
    pci = TestClient(
        make_app(nvml=Nvml(FakePynvml(gpus), environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    )

    for client, cuda_0 in ((fastest, "GPU-h100"), (pci, "GPU-l4")):
        plan = client.post("/v1/plan", json=local_plan({"cuda_index": 0})).json()
        assert plan["device"]["uuid"] == cuda_0
        listed = client.get("/v1/devices").json()["devices"]
        assert {d["uuid"]: d["cuda_index"] for d in listed}[cuda_0] == 0


# -- MIG and unreadable cards ------------------------------------------------------------------


def mig_node() -> list[FakeGpu]:
    no_permission = ERROR_CLASSES["NVMLError_NoPermission"]
    instance = FakeGpu(
        uuid="MIG-11112222-3333-4444-5555-666677778888",
        name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        total=40 * GiB - 512 * MiB,
        free=39 * GiB,
    )
    parent = FakeGpu(
        uuid="GPU-aaaa0000-1111-2222-3333-444455556666",
        name="NVIDIA H100 80GB HBM3",
        total=80 * GiB,
        free=40 * GiB,
        mig_mode=1,
        mig_slots={0: instance},
        memory_v2_error=no_permission,
        memory_v1_error=no_permission,
    )
    return [parent]


def test_mig_parent_without_permission_breaks_nothing(make_app: Callable[..., FastAPI]) -> None:
    mig_uuid = "MIG-11112222-3333-4444-5555-666677778888"
    nvml = Nvml(FakePynvml(mig_node()), environ={"NVIDIA_VISIBLE_DEVICES": mig_uuid})
    client = TestClient(make_app(nvml=nvml, require_gpu=True))

    devices = client.get("/v1/devices").json()["devices"]
    assert [(d["is_mig"], d["memory_reason"], d["mig_profile"]) for d in devices] == [
        (False, "no_permission", ""),
        (True, None, "3g.40gb"),
    ]
    assert devices[1]["total_memory_bytes"] == 40 * GiB - 512 * MiB
    plan = client.post("/v1/plan", json=local_plan({"uuid": mig_uuid}))
    assert plan.status_code == 200
    assert plan.json()["device"]["capacity_bytes"] == 40 * GiB - 512 * MiB
    assert plan.json()["device"]["mig_profile"] == "3g.40gb"
    assert client.get("/readyz").json()["num_gpus"] == 1


def test_an_unreadable_card_never_hides_a_healthy_one(make_app: Callable[..., FastAPI]) -> None:
    not_supported = ERROR_CLASSES["NVMLError_NotSupported"]
    gpus = [
        FakeGpu(
            uuid="GPU-gb10",
            name="NVIDIA GB10",
            total=0,
            free=0,
            memory_v2_error=not_supported,
            memory_v1_error=not_supported,
        ),
        FakeGpu(uuid=H100_UUID, name="NVIDIA H100 NVL", total=94 * GiB, free=90 * GiB),
    ]
    nvml = Nvml(FakePynvml(gpus), environ={}, torch_mem_get_info=lambda uuid: None)
    client = TestClient(make_app(nvml=nvml, require_gpu=True))

    devices = client.get("/v1/devices").json()["devices"]
    assert [(d["uuid"], d["total_memory_bytes"], d["memory_source"]) for d in devices] == [
        ("GPU-gb10", None, "unknown"),
        (H100_UUID, 94 * GiB, "nvml"),
    ]
    assert devices[0]["memory_reason"] == "not_supported"
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["num_gpus"] == 2
    assert client.post("/v1/plan", json=local_plan({"uuid": H100_UUID})).status_code == 200
    unknown = client.post("/v1/plan", json=local_plan({"cuda_index": 0}))
    assert unknown.status_code == 503 and problem_type(unknown) == "memory-unknown"
    assert "capacity_bytes" in unknown.json()["detail"]


def test_v1_memory_api_flags_used_as_including_the_reserve(
    make_app: Callable[..., FastAPI],
) -> None:
    gpus = two_gpus()
    gpus[0].memory_v2_error = ERROR_CLASSES["NVMLError_FunctionNotFound"]
    client = TestClient(make_app(nvml=Nvml(FakePynvml(gpus), environ={})))

    first, second = client.get("/v1/devices").json()["devices"]
    assert (first["reserved_memory_bytes"], first["used_includes_reserved"]) == (None, True)
    assert (second["reserved_memory_bytes"], second["used_includes_reserved"]) == (0, False)


# -- memory "total" while others hold memory ---------------------------------------------------


def test_a_total_plan_says_what_other_processes_hold(make_app: Callable[..., FastAPI]) -> None:
    gpus = two_gpus()
    gpus[0].free, gpus[0].used_v2 = 50 * GiB, 30 * GiB  # another job holds 30 GiB
    client = TestClient(make_app(nvml=Nvml(FakePynvml(gpus), environ={})))

    total = client.post("/v1/plan", json=local_plan({"cuda_index": 0})).json()["device"]
    assert total["capacity_bytes"] == 80 * GiB
    assert total["memory_held_by_others_bytes"] == 30 * GiB
    assert "assumes they will be gone" in total["note"] and '"free"' in total["note"]
    free = client.post("/v1/plan", json=local_plan({"cuda_index": 0, "memory": "free"}))
    assert free.json()["device"]["capacity_bytes"] == 50 * GiB
    assert free.json()["device"]["note"] is None
    idle = client.post("/v1/plan", json=local_plan({"cuda_index": 1})).json()["device"]
    assert (idle["memory_held_by_others_bytes"], idle["note"]) == (0, None)


# -- probe runs --------------------------------------------------------------------------------


def test_a_probe_child_sees_the_containers_cards_in_the_services_numbering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import autobatch.device._nvml as nvml_module
    from service.probes.runs import _pin_visible_devices

    given = Nvml(FakePynvml(two_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": H100_UUID})
    monkeypatch.setattr(nvml_module, "_default_nvml", given)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what a privileged pod's CUDA would use

    _pin_visible_devices()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == H100_UUID  # the child's cuda:0 is cuda_index 0


def test_a_probe_while_the_gpu_listing_hangs_is_503_not_unknown_device(
    make_app: Callable[..., FastAPI], registry_file: Any
) -> None:
    fake = FakePynvml(two_gpus(), init_delay_s=1.0)  # nvmlInit itself hangs past the timeout
    client = TestClient(
        make_app(nvml=Nvml(fake, environ={}), config_file=registry_file, nvml_timeout_seconds=0.1)
    )
    response = client.post("/v1/probes", json={"model": "tiny-mlp", "device": "cuda:0"})
    assert response.status_code == 503 and problem_type(response) == "nvml_timeout"
    assert client.get("/v1/probes").json()["probes"] == []  # nothing was queued
