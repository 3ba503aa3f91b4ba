"""POST /v1/plan and ``autobatch plan`` answer with the library's planning entries
(autobatch.planning.plan_request and plan_table, the budget on their plans), not a copy of
them."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from autobatch.cli import main
from autobatch.planning import PlanRequest, given_budget, plan_request, plan_table
from autobatch.profile import MemoryModel

GIB = 2**30
LINE = MemoryModel(fixed_bytes=GIB, bytes_per_sample=100 * 2**20)


def test_the_route_answers_what_the_entries_plan(client: TestClient) -> None:
    body = {
        "memory_model": {
            "fixed_bytes": LINE.fixed_bytes,
            "bytes_per_sample": LINE.bytes_per_sample,
        },
        "device": {"capacity_bytes": 16 * GIB},
        "gpu_fraction": 0.5,
        "effective_batch_size": 256,
        "world_size": 2,
        "world_sizes": [1, 2, 3],
    }
    answer = client.post("/v1/plan", json=body).json()
    budget = given_budget(16 * GIB, gpu_fraction=0.5)
    request = PlanRequest(
        effective_batch_size=256,
        world_size=2,
        world_sizes=(1, 2, 3),
        capacity_bytes=budget.budget_bytes,
    )
    planned = plan_request(LINE, request, budget=budget)
    assert answer["plan"] == json.loads(json.dumps(planned.to_dict()))
    assert answer["plan"]["budget"]["trials_per_gpu"] == 2
    rows = plan_table(LINE, request, budget=budget)
    assert [row["plan"] for row in answer["world_size_options"]] == [
        None if row.plan is None else json.loads(json.dumps(row.plan.to_dict())) for row in rows
    ]
    assert answer["world_size_options"][1]["plan"]["budget"]["trials_per_gpu"] == 2


def test_the_cli_table_is_plan_tables_rows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "96"]
    assert main([*argv, "--world-size", "1,2,5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    planned = plan_table(24, PlanRequest(effective_batch_size=96, world_sizes=(1, 2, 5)))
    assert [row["plan"] for row in rows] == [
        None if row.plan is None else json.loads(json.dumps(row.plan.to_dict())) for row in planned
    ]
    assert rows[2]["plan"] is None and "not a multiple of --world-size 5" in rows[2]["reason"]
