"""``POST /v1/plan`` against odd inputs, beside ``autobatch plan`` on the same numbers: every
answer is a plan that keeps ``E = m x k x dp`` or a problem naming the field and the fix, and
the service and the command line accept and refuse alike."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from autobatch.cli import main as cli_main
from autobatch.planning import MAX_GRADIENT_ACCUMULATION_STEPS

JSON = {"Content-Type": "application/json"}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli_main(["plan", *argv])
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"max_micro_batch_size": 8, "uneven": "\xff"}', "not UTF-8 text"),
        (b"[" * 5000 + b"]" * 5000, "nested too deep"),
        (b'{"effective_batch_size": 1' + b"0" * 4400 + b"}", "4300 digits"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/plan", "/v1/profiles"])
def test_a_body_json_cannot_read_is_400_naming_the_body_and_the_fix(
    client: TestClient, route: str, content: bytes, reason: str
) -> None:
    """Not text, nested or a number past what json.loads reads: the plan route (which reads its
    own body) and a route with a declared body (FastAPI reads it) answer alike, the body named."""
    response = client.post(route, content=content, headers=JSON)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["type"] == "urn:autobatch:problem:malformed-json"
    assert [error["field"] for error in body["errors"]] == ["body"]
    assert reason in body["errors"][0]["reason"]
    assert "send" in body["errors"][0]["reason"]  # the fix


def test_uneven_always_with_multiple_of_names_the_request_fields(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    response = client.post(
        "/v1/plan",
        json={
            "max_micro_batch_size": 24,
            "effective_batch_size": 97,
            "multiple_of": 8,
            "uneven": "always",
        },
    )
    assert response.status_code == 422
    assert response.json()["detail"].endswith('use "uneven": "auto", or "multiple_of": 1')
    code, _, err = cli(
        capsys, "--max-micro-batch-size", "24", "--effective-batch-size", "97",
        "--multiple-of", "8", "--uneven", "always",
    )  # fmt: skip
    assert code == 1
    assert err.splitlines()[0].endswith("use --uneven auto, or --multiple-of 1")


@pytest.mark.parametrize("steps", [100_000, MAX_GRADIENT_ACCUMULATION_STEPS])
def test_an_accumulation_bound_the_planner_takes_is_taken_by_both(
    client: TestClient, capsys: pytest.CaptureFixture[str], steps: int
) -> None:
    """The service took at most 65536 where the planner (and the CLI) take 2**20."""
    response = client.post(
        "/v1/plan",
        json={
            "max_micro_batch_size": 1,
            "effective_batch_size": 100_000,
            "max_gradient_accumulation_steps": steps,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["plan"]["gradient_accumulation_steps"] == 100_000
    code, out, _ = cli(
        capsys, "--max-micro-batch-size", "1", "--effective-batch-size", "100000",
        "--max-gradient-accumulation-steps", str(steps),
    )  # fmt: skip
    assert code == 0
    assert "gradient_accumulation_steps  100000" in out


def test_an_accumulation_bound_past_the_planner_s_is_refused_by_both(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused, naming the largest, rather than clamped to 2**20 (a later error would speak of a
    bound the user had not set)."""
    steps = MAX_GRADIENT_ACCUMULATION_STEPS + 1
    response = client.post(
        "/v1/plan",
        json={
            "max_micro_batch_size": 1,
            "effective_batch_size": 8,
            "max_gradient_accumulation_steps": steps,
        },
    )
    assert response.status_code == 422
    body = response.json()
    assert [error["field"] for error in body["errors"]] == ["body.max_gradient_accumulation_steps"]
    assert str(MAX_GRADIENT_ACCUMULATION_STEPS) in body["detail"]
    code, _, err = cli(
        capsys, "--max-micro-batch-size", "1", "--effective-batch-size", "8",
        "--max-gradient-accumulation-steps", str(steps),
    )  # fmt: skip
    assert code != 0
    assert f"argument --max-gradient-accumulation-steps: {steps} is more than" in err
    assert f"at most {MAX_GRADIENT_ACCUMULATION_STEPS}" in err


@pytest.mark.parametrize(
    "extra",
    [
        {"world_size": 2},
        {"data_parallel_size": 2},
        {"world_size": 2, "uneven": "always"},
    ],
)
def test_uneven_plans_state_a_formula_whose_numbers_multiply(
    client: TestClient, extra: dict[str, Any]
) -> None:
    """``E = (sum of one rank's micro-batches) x dp``: the note's numbers give E."""
    response = client.post(
        "/v1/plan", json={"max_micro_batch_size": 24, "effective_batch_size": 194, **extra}
    )
    plan = response.json()["plan"]
    (note,) = [note for note in plan["notes"] if "(data-parallel ranks)" in note]
    per_rank = sum(plan["micro_batch_sizes"])
    assert per_rank * plan["world_size"] == plan["effective_batch_size"]
    assert note.startswith(f"effective_batch_size {plan['effective_batch_size']} = {per_rank} ")
    assert note.endswith(f"x {plan['world_size']} (data-parallel ranks)")


@pytest.mark.parametrize(
    "content_types",
    [
        ["application/json", "text/plain"],
        ["text/plain", "application/json"],
        ["application/json", "application/json"],
    ],
)
@pytest.mark.parametrize("route", ["/v1/plan", "/v1/profiles"])
def test_two_content_type_headers_are_refused(
    client: TestClient, route: str, content_types: list[str]
) -> None:
    """Which one a proxy reads is anyone's guess (the first was taken here), so neither is."""
    response = client.post(
        route,
        content=b'{"max_micro_batch_size": 8, "effective_batch_size": 16}',
        headers=[("Content-Type", value) for value in content_types],
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "urn:autobatch:problem:duplicate-header"
    assert [error["field"] for error in body["errors"]] == ["header.content-type"]
    assert "send one Content-Type header" in body["detail"]


@pytest.mark.parametrize("route", ["/v1/plan", "/v1/profiles"])
def test_an_empty_body_names_the_fix(client: TestClient, route: str) -> None:
    response = client.post(route, content=b"", headers=JSON)
    assert response.status_code == 422
    body = response.json()
    assert [error["field"] for error in body["errors"]] == ["body"]
    assert "the request body is empty; send a JSON object" in body["detail"]


def test_a_number_past_python_s_digit_limit_is_refused_by_the_cli_as_too_long(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = cli(capsys, "--max-micro-batch-size", "24", "--effective-batch-size", "1" * 5000)
    assert code == 2
    assert "has 5000 digits" in err
    assert "1" * 100 not in err  # not echoed whole


def test_an_unknown_route_or_method_names_the_fix(client: TestClient) -> None:
    response = client.post("/v1/PLAN", json={})
    assert response.status_code == 404
    assert response.json()["detail"] == (
        "no route POST /v1/PLAN; the routes are listed in /openapi.json"
    )
    response = client.get("/v1/plan")
    assert response.status_code == 405
    assert response.json()["detail"] == "GET is not allowed on /v1/plan; use POST"


@pytest.mark.parametrize(
    ("raw", "field", "fix"),
    [
        ('"effective_batch_size": 64.0', "body.effective_batch_size", "send 64, not 64.0"),
        ('"effective_batch_size": 6.4e1', "body.effective_batch_size", "send 64, not 64.0"),
        ('"effective_batch_size": 8, "world_sizes": [1, 2.0]', "body.world_sizes.1", "send 2,"),
    ],
)
def test_a_whole_float_where_an_int_belongs_names_the_int_to_send(
    client: TestClient, raw: str, field: str, fix: str
) -> None:
    response = client.post(
        "/v1/plan", content='{"max_micro_batch_size": 24, ' + raw + "}", headers=JSON
    )
    assert response.status_code == 422
    body = response.json()
    assert [error["field"] for error in body["errors"]] == [field]
    assert fix in body["errors"][0]["reason"]


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        (b"[8]", "body", "Input should be a JSON object, not an array"),
        (b'"plan"', "body", "Input should be a JSON object, not a string"),
        (b"null", "body", "Input should be a JSON object, not null"),
        (
            b'{"max_micro_batch_size": 8, "effective_batch_size": 8, "device": "cuda:0"}',
            "body.device",
            "Input should be a JSON object, not a string",
        ),
    ],
)
def test_a_value_that_should_be_an_object_says_so_in_json_terms(
    client: TestClient, raw: bytes, field: str, reason: str
) -> None:
    """Not pydantic's "valid dictionary or object to extract fields from" (a Python wording)."""
    response = client.post("/v1/plan", content=raw, headers=JSON)
    assert response.status_code == 422
    assert [(e["field"], e["reason"]) for e in response.json()["errors"]] == [(field, reason)]


@pytest.mark.parametrize(
    ("body", "field", "hint"),
    [
        (
            {"micro_batch_size": 24, "effective_batch_size": 64},
            "body.micro_batch_size",
            'did you mean "max_micro_batch_size"?',
        ),
        (
            {"max_micro_batch_size": 24, "effective_batch_size": 64, "worldsize": 2},
            "body.worldsize",
            'did you mean "world_size"?',
        ),
        (
            {
                "memory_model": {"fixed_bytes": 0, "bytes_per_sample": 1},
                "effective_batch_size": 64,
                "device": {"capacity": 2**30},
            },
            "body.device.capacity",
            'did you mean "capacity_bytes"?',
        ),
        (
            {"max_micro_batch_size": 24, "effective_batch_size": 64, "zzz": 1},
            "body.zzz",
            'the fields are "profile_id", "model_fingerprint", "max_micro_batch_size"',
        ),
    ],
)
def test_an_unknown_field_names_the_likely_one(
    client: TestClient, body: dict[str, Any], field: str, hint: str
) -> None:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422
    reasons = {e["field"]: e["reason"] for e in response.json()["errors"]}
    assert reasons[field].startswith("Extra inputs are not permitted; ")
    assert hint in reasons[field]


def test_an_unknown_field_names_the_likely_one_in_a_declared_body_too(client: TestClient) -> None:
    """Routes whose body FastAPI reads (a probe run's) word it as the plan route does."""
    response = client.post("/v1/probes", json={"modle": "tiny-mlp"})
    assert response.status_code == 422
    reasons = {e["field"]: e["reason"] for e in response.json()["errors"]}
    assert reasons["body.modle"] == 'Extra inputs are not permitted; did you mean "model"?'


def test_a_table_too_long_to_answer_is_refused_before_it_is_planned(client: TestClient) -> None:
    # Found by the breaker: 200 bytes asked for 33 plans of 2**20 micro-batches each, and got
    # 69 MB back after 1.9 s; later 86 bytes (world sizes [1, 1, 1]) got 8.4 MB.
    from service.plans.limits import MAX_ANSWER_MICRO_BATCHES as CAP

    world_sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    body = {"max_micro_batch_size": 1, "effective_batch_size": CAP, "world_sizes": world_sizes}
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422, response.text[:200]
    problem = response.json()
    assert problem["errors"][0]["field"] == "body.world_sizes"
    least = CAP + sum(CAP // w for w in world_sizes)
    assert f"at least {least} micro-batch sizes" in problem["detail"]
    assert f"at most {CAP} per answer" in problem["detail"]
    assert "ask fewer world_sizes" in problem["detail"]
    # A plan alone past the cap is refused too, naming the effective batch.
    alone = {"max_micro_batch_size": 1, "effective_batch_size": 2**20}
    response = client.post("/v1/plan", json=alone)
    assert response.status_code == 422, response.text[:200]
    assert response.json()["errors"][0]["field"] == "body.effective_batch_size"
    assert "would list 1048576 micro-batch sizes" in response.json()["detail"]
    # A plan at the cap, and a table that stays under it, are still answered.
    at_cap = {"max_micro_batch_size": 1, "effective_batch_size": CAP}
    assert len(client.post("/v1/plan", json=at_cap).json()["plan"]["micro_batch_sizes"]) == CAP
    table = {**at_cap, "world_sizes": [2, 4, 8], "effective_batch_size": CAP // 2}
    rows = client.post("/v1/plan", json=table).json()["world_size_options"]
    steps = [row["plan"]["gradient_accumulation_steps"] for row in rows]
    assert steps == [CAP // 4, CAP // 8, CAP // 16]


def test_a_world_size_given_twice_is_refused(client: TestClient) -> None:
    # Found by the breaker: 86 bytes, world sizes [1, 1, 1], three identical 2**20-step rows.
    body = {"max_micro_batch_size": 1, "effective_batch_size": 2**20, "world_sizes": [1, 1, 1]}
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422
    assert response.json()["errors"] == [
        {
            "field": "body.world_sizes",
            "reason": "lists 1 more than once: each world size is one row of the table, give "
            "each once",
        }
    ]
    assert len(response.content) < 1000


_MODEL = {"fixed_bytes": 1_000_000, "bytes_per_sample": 1000}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        # A library error about one field: the field its message leads with.
        ({"max_micro_batch_size": 24, "effective_batch_size": 97, "world_size": 4},
         "body.effective_batch_size"),
        ({"max_micro_batch_size": 24, "effective_batch_size": 64, "multiple_of": 32},
         "body.multiple_of"),
        ({"max_micro_batch_size": 24, "effective_batch_size": 97, "multiple_of": 8,
          "uneven": "always"}, "body.uneven"),
        # ... or the first field it names.
        ({"max_micro_batch_size": 1, "effective_batch_size": 1000,
          "max_gradient_accumulation_steps": 4}, "body.effective_batch_size"),
        # A field inside another: its whole path.
        ({"memory_model": _MODEL, "effective_batch_size": 64, "device": {"capacity_bytes": 80}},
         "body.device.capacity_bytes"),
        # A check of the whole body (a model validator): the field its message is about.
        ({"memory_model": _MODEL, "effective_batch_size": 64, "card": "H100"}, "body.card"),
    ],
)  # fmt: skip
def test_every_422_names_the_field_at_fault_not_the_body(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422, response.text
    assert [error["field"] for error in response.json()["errors"]] == [field]


def test_a_capacity_remedy_over_http_is_set_inside_the_device(client: TestClient) -> None:
    body = {"memory_model": _MODEL, "effective_batch_size": 64, "device": {"capacity_bytes": 80}}
    detail = client.post("/v1/plan", json=body).json()["detail"]
    assert detail.endswith(
        'use "device": {"capacity_bytes": 85899345920} (80 GiB, if the unit was left off)'
    )
