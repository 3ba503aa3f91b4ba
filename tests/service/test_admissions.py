"""POST /v1/admissions over real stored profiles (an in-process app): accepted with the plan and
its variables, unreachable with the nearest batches, sized, unplanned, and bad bodies."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.admissions.schemas import AdmissionPublic
from tests.service.test_service_api import make_profile, problem

H100, B999 = "NVIDIA H100 80GB HBM3", "NVIDIA B999"  # no catalogue entry: memory unknown


def admit(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/admissions",
        json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 256, **body},
    )
    assert response.status_code == 200, response.text
    AdmissionPublic.model_validate(response.json())
    answer: dict[str, Any] = response.json()
    return answer


def test_admissions(client: TestClient) -> None:
    published = client.post(
        "/v1/profiles", json=make_profile(device_name=H100, node_name="node-a").to_dict()
    )
    assert published.status_code == 201, published.text
    profile_id = published.json()["id"]

    # Accepted on 8 GPUs: 32 each (the profile recommends 36), one step; its variables.
    accepted = admit(client, cards=[H100], world_size=8)
    assert (accepted["outcome"], accepted["card"], accepted["world_size"]) == ("accepted", H100, 8)
    assert accepted["profile_id"] == profile_id
    assert accepted["selection"]["match"] == "measured"
    assert accepted["plan"]["micro_batch_size"] == 32
    env = accepted["environment"]
    assert env["AUTOBATCH_MICRO_BATCH_SIZE"] == "32"
    assert env["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"] == "1"
    assert env["AUTOBATCH_WORLD_SIZE"] == "8"
    assert env["AUTOBATCH_PROFILE_ID"] == profile_id
    assert env["AUTOBATCH_PLAN_SOURCE"] == "cached"  # the JSON plan's source
    assert env["AUTOBATCH_PROFILE_MATCH"] == "measured"  # measured on the card asked
    assert accepted["message"].startswith("accepted: effective batch 256 = micro-batch 32 x 1")

    # 97 on 8 GPUs: refused, naming 96 and 104, and 1 GPU (the only count 97 divides).
    refused = admit(client, cards=[H100], world_size=8, effective_batch_size=97)
    assert refused["outcome"] == "unreachable"
    assert (refused["plan"], refused["environment"]) == (None, {})
    assert refused["nearest_effective_batch_sizes"] == [96, 104]
    assert refused["reaching_world_sizes"] == [1]
    assert "nearest reachable effective batch sizes: 96, 104" in refused["message"]

    # Sized within a policy: the B999 is not catalogued and has no profile, so its memory is
    # unknown: the H100; of 8 and 16 GPUs (32 is past the ceiling) the fewest: 4096 / 8 = 512 =
    # 32 x 16 steps.
    sized = admit(
        client,
        cards=[B999, H100],
        effective_batch_size=4096,
        policy={"size": True, "allowed_world_sizes": [8, 16, 32], "max_world_size": 16},
    )
    assert (sized["outcome"], sized["card"], sized["world_size"]) == ("sized", H100, 8)
    assert sized["environment"]["AUTOBATCH_WORLD_SIZE"] == "8"
    assert sized["environment"]["AUTOBATCH_GRADIENT_ACCUMULATION_STEPS"] == "16"
    assert sized["reasons"][1] == (
        f"{B999}: no stored profile (of any model) was measured on this card, so its memory is "
        "unknown; check the name against GET /v1/profiles' device_name"
    )
    assert sized["reaching_world_sizes"] == [8, 16]
    assert sized["message"].startswith(f"sized to 8 GPUs of {H100}: the fewest GPUs")

    # A model with no profile: admitted unchanged.
    unknown = admit(client, model_fingerprint="fp-none", cards=[H100], world_size=8)
    assert (unknown["outcome"], unknown["world_size"], unknown["plan"]) == ("unplanned", None, None)
    assert unknown["reasons"][0].startswith(f"{H100}: ")

    # No card given: drawn among the nodes, on the card the most nodes measured.
    anywhere = admit(client, world_size=4)
    assert (anywhere["outcome"], anywhere["card"], anywhere["world_size"]) == ("accepted", None, 4)
    assert anywhere["plan"]["micro_batch_size"] == 32  # 64 per GPU: 32 x 2


def test_bad_bodies_name_the_field(client: TestClient) -> None:
    response = client.post(
        "/v1/admissions", json={"model_fingerprint": "fp", "effective_batch_size": 8}
    )
    assert "policy.size" in problem(response, 422, "validation")["detail"]
    response = client.post(
        "/v1/admissions",
        json={"model_fingerprint": "fp", "effective_batch_size": 8, "world_size": 0},
    )
    assert problem(response, 422, "validation")["errors"][0]["field"] == "body.world_size"


def test_sizing_with_no_allowed_count_under_the_ceiling_is_a_422_not_a_500(
    client: TestClient,
) -> None:
    # The policy is checked as a whole: a ceiling below every allowed count allows no count
    # (planning at none raised inside the handler: a 500), sized or asked alike.
    published = client.post(
        "/v1/profiles", json=make_profile(device_name=H100, node_name="node-a").to_dict()
    )
    assert published.status_code == 201, published.text
    policy = {"size": True, "max_world_size": 3, "allowed_world_sizes": [8, 4]}
    for asked in ({}, {"world_size": 4}, {"policy": {**policy, "size": False}, "world_size": 4}):
        response = client.post(
            "/v1/admissions",
            json={
                "model_fingerprint": "fp-gpt2",
                "effective_batch_size": 64,
                "policy": policy,
                **asked,
            },
        )
        body = problem(response, 422, "validation")
        assert body["errors"][0]["field"] == "body.policy"
        assert "max_world_size 3 is below every allowed_world_sizes (4, 8)" in body["detail"]
        assert "raise max_world_size to at least 4" in body["detail"]
    # A ceiling at the smallest allowed count sizes to it.
    sized = admit(client, cards=[H100], policy={**policy, "max_world_size": 4})
    assert (sized["outcome"], sized["world_size"]) == ("sized", 4)


def _publish(client: TestClient) -> None:
    published = client.post("/v1/profiles", json=make_profile(device_name=H100).to_dict())
    assert published.status_code == 201, published.text


def _planned_counts(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The GPU counts each card's plan table is asked for, call by call."""
    from service.plans.planner import plan_world_sizes as real

    asked: list[list[int]] = []

    def recording(body: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(list(body.world_sizes))
        return real(body, *args, **kwargs)

    monkeypatch.setattr("service.admissions.answer.plan_world_sizes", recording)
    return asked


def test_a_job_at_its_asked_count_is_planned_there_alone(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 GPUs, 3,000 accumulation steps of 36: POST /v1/plan answers it, and so does the
    admission, planning only the 64 asked (the unasked counts 1 to 32 would need 6,912,000 /
    36 steps at 1 GPU, more than an answer lists, and are no part of an accepted answer)."""
    _publish(client)
    ebs = 36 * 64 * 3000
    planned = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "card": H100, "effective_batch_size": ebs,
              "world_sizes": [64]},
    )  # fmt: skip
    assert planned.status_code == 200, planned.text
    counts = _planned_counts(monkeypatch)
    accepted = admit(client, cards=[H100], world_size=64, effective_batch_size=ebs)
    assert accepted["outcome"] == "accepted"
    plan = accepted["plan"]
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (36, 3000)
    assert counts == [[64]]


def test_an_unreachable_job_plans_the_allowed_counts_to_name_those_that_reach(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _publish(client)
    counts = _planned_counts(monkeypatch)
    refused = admit(client, cards=[H100], world_size=8, effective_batch_size=97)
    assert refused["outcome"] == "unreachable"
    assert refused["reaching_world_sizes"] == [1]
    assert counts == [[8], [1, 2, 4, 8, 16, 32, 64]]


@pytest.mark.parametrize("world_size", [65536, 1, 3])
def test_the_nearest_effective_batches_named_can_be_asked_and_are_answered(
    client: TestClient, world_size: int
) -> None:
    """The largest batch a body may ask (2**31 - 1) at 65536 GPUs is unreachable; the nearest
    above (2**31) is beyond the schema and is not named. At 1 GPU, the nearest below is one an
    answer can list (at most 262,144 accumulation steps), not 2**29 in 2**20 steps of 512."""
    _publish(client)
    largest = 2**31 - 1
    refused = admit(client, cards=[H100], world_size=world_size, effective_batch_size=largest)
    assert refused["outcome"] == "unreachable"
    nearest = refused["nearest_effective_batch_sizes"]
    assert nearest and all(1 <= size <= largest for size in nearest)
    for size in nearest:
        again = admit(client, cards=[H100], world_size=world_size, effective_batch_size=size)
        assert again["outcome"] == "accepted", again["reasons"]
        assert again["plan"]["effective_batch_size"] == size
