"""Faults found by trying to break the newest service features (admissions, arrival checks,
plans drawn among nodes, token files reloading, deletions as tombstones). Each test states
what should happen; an ``xfail(strict=True)`` one fails today."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.profile import MemoryModel, Trial
from tests.helpers.fake_pynvml import GiB, MiB
from tests.service.conftest import no_nvml
from tests.service.test_fleet_trust import H100, HONEST, L40S, node_profile, publish


@pytest.fixture
def central(make_app: Callable[..., FastAPI]) -> TestClient:
    return TestClient(make_app(nvml=no_nvml()), raise_server_exceptions=False)


def _plan(client: TestClient, **body: Any) -> Any:
    return client.post(
        "/v1/plan", json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 65536, **body}
    )


def test_a_non_cuda_profile_under_a_catalogued_card_name_is_refused(central: TestClient) -> None:
    fake = node_profile(
        "node-a",
        500_000,
        500_000,
        device_type="cpu",
        total_memory_bytes=2**50,
        capacity_bytes=2**50,
        memory_model=MemoryModel(fixed_bytes=0, bytes_per_sample=1),
        trials=(Trial(micro_batch_size=500_000, fits=True, peak_allocated_bytes=2**40),),
    )
    response = central.post("/v1/profiles", json=fake.to_dict())
    stored = response.status_code == 201
    # Either refused on arrival, or never planning a real card from a petabyte.
    for card in (H100, L40S):
        answer = _plan(central, card=card)
        if answer.status_code == 200:
            assert answer.json()["plan"]["capacity_bytes"] <= 100 * GiB, card
    assert not stored, "an H100 with 1 PiB of memory cannot be true (422 implausible-profile)"


def test_a_lone_low_node_does_not_undercut_two_nodes_that_ran_more(central: TestClient) -> None:
    capped = [
        node_profile(
            node, 64, 64, stop_kind="limit", stop_reason="limit max_micro_batch_size=64 reached"
        )
        for node in ("node-b", "node-c")
    ]
    publish(central, *capped)
    before = _plan(central, card=H100, effective_batch_size=64).json()["plan"]
    assert before["micro_batch_size"] == 64
    liar = node_profile(
        "node-z", 1, 1, trials=(Trial(micro_batch_size=1, fits=True, peak_allocated_bytes=GiB),)
    )
    publish(central, liar)
    after = _plan(central, card=H100, effective_batch_size=64).json()["plan"]
    assert after["micro_batch_size"] == 64  # today: 1 (x 64 accumulation steps)


def test_a_lone_node_on_a_bigger_card_does_not_move_a_predicted_plan(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    before = _plan(central, card=L40S, effective_batch_size=4096).json()["plan"]
    liar = node_profile(
        "node-z",
        4096,
        4096,
        device_name="NVIDIA H200",
        total_memory_bytes=140 * GiB,
        capacity_bytes=139 * GiB,
        memory_model=MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=16 * MiB),
        trials=(Trial(micro_batch_size=4096, fits=True, peak_allocated_bytes=68 * GiB),),
    )
    publish(central, liar)
    after = _plan(central, card=L40S, effective_batch_size=4096).json()["plan"]
    assert after["micro_batch_size"] <= 2 * before["micro_batch_size"]


def test_a_smaller_card_is_never_predicted_past_a_bigger_card_s_measured_maximum(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    answer = _plan(central, card=L40S, effective_batch_size=1024).json()
    assert answer["selection"]["device_name"] == H100
    assert answer["plan"]["max_micro_batch_size"] <= 64


def test_a_mig_slice_claiming_the_whole_card_s_memory_is_refused(central: TestClient) -> None:
    slice_ = node_profile("node-m", 64, 60, device_name="NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    response = central.post("/v1/profiles", json=slice_.to_dict())
    assert response.status_code == 422


def test_an_admission_s_environment_says_the_checkpointing_its_micro_batch_needs(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    line = MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=GiB // 4)
    publish(
        central,
        *(
            node_profile(
                node,
                200,
                190,
                activation_checkpointing="full",
                memory_model=line,
                created_at="2026-12-01T00:00:00+00:00",
            )
            for node in ("node-b", "node-c", "node-d")
        ),
    )
    answer = central.post(
        "/v1/admissions",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 190,
            "world_size": 1,
            "cards": [H100],
        },
    ).json()
    # No mode asked: planned from the plain profiles only, and the environment says so.
    assert answer["plan"]["activation_checkpointing"] == "none"
    assert answer["environment"]["AUTOBATCH_ACTIVATION_CHECKPOINTING"] == "none"
    assert int(answer["environment"]["AUTOBATCH_MICRO_BATCH_SIZE"]) <= 62
    by_card = _plan(central, card=H100).json()
    assert by_card["plan"]["activation_checkpointing"] == "none"
    assert by_card["plan"]["micro_batch_size"] <= 60
    by_node = _plan(central, node="node-c").json()
    assert by_node["plan"]["activation_checkpointing"] == "none"
    full = _plan(central, card=H100, conditions={"activation_checkpointing": "full"}).json()
    assert full["plan"]["activation_checkpointing"] == "full"
