"""POST /v1/plan by card type or node (a central service's question), over real stored profiles."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from autobatch.conditions import Conditions
from autobatch.profile import Profile
from service.plans.schemas import PlanPublic
from tests.helpers.fake_pynvml import GiB
from tests.service.test_service_api import make_profile, problem

H100, A100, L4 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"
BF16 = Conditions(device_type="cuda", amp_dtype="bfloat16")


def publish(client: TestClient, profile: Profile) -> str:
    response = client.post("/v1/profiles", json=profile.to_dict())
    assert response.status_code == 201, response.text
    profile_id: str = response.json()["id"]
    return profile_id


def plan(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/plan", json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 64, **body}
    )
    assert response.status_code == 200, response.text
    PlanPublic.model_validate(response.json())
    answer: dict[str, Any] = response.json()
    return answer


def test_card_plans_from_any_nodes_profile_measured_on_that_card(client: TestClient) -> None:
    on_a = publish(client, make_profile(device_name=H100, node_name="node-a", conditions=BF16))
    publish(client, make_profile(device_name=A100, node_name="node-b", conditions=BF16))

    answer = plan(client, card=H100, conditions={"amp_dtype": "bfloat16"})

    assert answer["selection"] == {
        "match": "measured",
        "profile_id": on_a,
        "node_name": "node-a",
        "device_name": H100,
        "card": H100,
        "reasons": [],
        "considered": [on_a],
        "max_micro_batch_size_range": [40, 40],
        "basis": "rests on node node-a alone: the only node that measured it (no other agrees "
        "on card, budget and conditions)",
        "outliers": [],
        "rests_on": "node-a",
        "lower_bounds": [],
        "measured_max_micro_batch_size": 40,  # the plan's limit is its recommended 36
        "measured_under": {
            "node_name": "node-a",
            "device_name": H100,
            "torch_version": "2.13.0",
            "device_type": "cuda",
            "amp_dtype": "bfloat16",
            "allocator_settings": "torch defaults",
        },
    }
    assert answer["profile_id"] == on_a
    assert answer["plan"]["micro_batch_size"] == 32  # the profile's recommended 36, 64 = 2 x 32
    assert answer["plan"]["source"] == "cached"
    # By node: node-b's own profile (an A100), measured.
    by_node = plan(client, node="node-b")
    assert by_node["selection"]["match"] == "measured"
    assert by_node["selection"]["device_name"] == A100


def test_other_conditions_answer_predicted_and_say_why(client: TestClient) -> None:
    on_a = publish(client, make_profile(device_name=H100, node_name="node-a", conditions=BF16))

    answer = plan(client, card=H100, conditions={"amp_dtype": "float16"})

    selection = answer["selection"]
    assert (selection["match"], selection["profile_id"]) == ("predicted", on_a)
    assert selection["reasons"] == [
        "measured under other conditions: amp_dtype: recorded 'bfloat16', asked 'float16'"
    ]
    assert any(
        note.startswith(f"predicted for {H100}, not measured") for note in answer["plan"]["notes"]
    )


def test_another_card_is_predicted_for_that_cards_memory(client: TestClient) -> None:
    # The model was measured on an 80 GiB card (limit 36 at 40 GiB usable); an L4 (24 GiB)
    # is known from another model's profile: the plan is scaled to 24 GiB and says predicted.
    on_a = publish(client, make_profile(device_name=A100, node_name="node-a"))
    publish(
        client,
        make_profile(
            device_name=L4,
            node_name="node-l",
            model_fingerprint="fp-other",
            total_memory_bytes=24 * GiB,
            capacity_bytes=24 * GiB,
        ),
    )

    answer = plan(client, card=L4)

    assert answer["selection"]["match"] == "predicted"
    assert answer["selection"]["profile_id"] == on_a
    assert answer["selection"]["reasons"] == [f"measured on {A100} (node node-a), not {L4}"]
    assert answer["plan"]["capacity_bytes"] == 24 * GiB
    # 4 GiB + 0.5 GiB per sample, past the 32 that ran, raised 2%, within 24 GiB x 0.95.
    assert answer["plan"]["max_micro_batch_size"] == 36
    assert answer["plan"]["source"] == "predicted"
    explicit = plan(client, card=L4, device={"capacity_bytes": 16 * GiB})
    assert explicit["plan"]["capacity_bytes"] == 16 * GiB
    assert explicit["plan"]["max_micro_batch_size"] == 22  # below the measured 32: the line


def test_unknown_card_memory_and_unknown_model_are_clear_problems(client: TestClient) -> None:
    publish(client, make_profile(device_name=A100, node_name="node-a"))

    response = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "card": "NVIDIA B999", "effective_batch_size": 64},
    )
    body = problem(response, 422, "unknown-card")
    assert "'NVIDIA B999' is not in autobatch's catalogue" in body["detail"]
    assert "device.capacity_bytes" in body["detail"]

    response = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-none", "card": A100, "effective_batch_size": 64},
    )
    body = problem(response, 404, "unknown-profile")
    assert "'fp-none'" in body["detail"] and f"card {A100!r}" in body["detail"]

    response = client.post(
        "/v1/plan",
        json={
            "model_fingerprint": "fp-gpt2",
            "card": A100,
            "conditions": {"amp": "bf16"},
            "effective_batch_size": 64,
        },
    )
    body = problem(response, 422, "validation")
    assert "unknown condition(s) 'amp':" in body["detail"]


def test_card_and_node_need_a_model_and_conditions_need_a_target(client: TestClient) -> None:
    response = client.post(
        "/v1/plan", json={"max_micro_batch_size": 8, "card": A100, "effective_batch_size": 64}
    )
    body = problem(response, 422, "validation")
    assert "give model_fingerprint with them" in response.text
    response = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp", "conditions": {}, "effective_batch_size": 64},
    )
    body = problem(response, 422, "validation")
    assert "conditions need card or node" in str(body)


def test_a_fleet_answer_names_what_its_profile_was_measured_under_and_where_the_job_differs(
    client: TestClient,
) -> None:
    # Measured under torch 2.11 with driver 550; the job runs torch 2.13 on the same card.
    old = publish(
        client,
        make_profile(
            device_name=H100,
            node_name="node-a",
            conditions=BF16,
            torch_version="2.11.0",
            driver_version="550.54.15",
        ),
    )
    asked = {"amp_dtype": "bfloat16", "torch_version": "2.13.0", "driver_version": "550.54.15"}

    selection = plan(client, card=H100, conditions=asked)["selection"]

    assert selection["profile_id"] == old
    assert selection["match"] == "predicted"  # not "measured": it rests on another torch
    assert selection["reasons"] == [
        "measured under other conditions: torch_version: recorded '2.11.0', asked '2.13.0'"
    ]
    under = selection["measured_under"]
    assert (under["torch_version"], under["driver_version"]) == ("2.11.0", "550.54.15")
    assert (under["node_name"], under["amp_dtype"]) == ("node-a", "bfloat16")
    # Not asked about the software: still measured, and the answer still names it.
    plain = plan(client, card=H100, conditions={"amp_dtype": "bfloat16"})["selection"]
    assert plain["match"] == "measured"
    assert plain["measured_under"]["torch_version"] == "2.11.0"


def test_an_unknown_condition_name_lists_the_software_names_too(client: TestClient) -> None:
    publish(client, make_profile(device_name=H100, node_name="node-a", conditions=BF16))
    response = client.post(
        "/v1/plan",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 64,
            "card": H100,
            "conditions": {"torch": "2.13.0"},
        },
    )
    assert response.status_code == 422, response.text
    assert "torch_version" in response.json()["detail"]
