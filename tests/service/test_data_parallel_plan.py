"""POST /v1/plan takes the data-parallel size, as autotune and the CLI do; says E = m x k x dp."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.web.schemas import ConditionsFields


def test_plan_over_data_parallel_ranks_echoes_the_formula(client: TestClient) -> None:
    body = {"max_micro_batch_size": 24, "effective_batch_size": 64, "data_parallel_size": 2}
    response = client.post("/v1/plan", json=body)

    assert response.status_code == 200, response.text
    plan = response.json()["plan"]
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (16, 2)
    assert plan["world_size"] == 2
    assert plan["notes"][-1] == (
        "effective_batch_size 64 = 16 (micro_batch_size) x 2 (gradient_accumulation_steps) x 2 "
        "(data-parallel ranks)"
    )


def test_world_size_and_a_different_data_parallel_size_are_refused(client: TestClient) -> None:
    body = {
        "max_micro_batch_size": 24,
        "effective_batch_size": 64,
        "world_size": 4,
        "data_parallel_size": 2,
    }
    response = client.post("/v1/plan", json=body)

    assert response.status_code == 422
    assert "world_size 4 and data_parallel_size 2 disagree" in response.text


def test_the_same_size_under_both_names_is_one_setting(client: TestClient) -> None:
    body = {
        "max_micro_batch_size": 24,
        "effective_batch_size": 64,
        "world_size": 2,
        "data_parallel_size": 2,
    }
    response = client.post("/v1/plan", json=body)

    assert response.status_code == 200, response.text
    assert response.json()["plan"]["world_size"] == 2


def test_conditions_sent_under_the_old_keys_read_as_world_size() -> None:
    old = {"device_type": "cuda", "data_parallel_size": 4, "data_parallel_source": "torchrun"}
    fields = ConditionsFields.model_validate(old)
    assert (fields.world_size, fields.world_size_source) == (4, "torchrun")
    assert "data_parallel_size" not in fields.model_dump()
