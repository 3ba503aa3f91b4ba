"""Answers that stay small and cheap whatever comes in, carry no server path, and a client that
leaves mid-body counted as what it is (499), not as the server's error. In process; the same
faults against a real server are in ``test_service_faults.py``."""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.probes.routes import probe_public
from service.probes.runs import ProbeRun
from service.web import problems
from service.web.problems import MAX_LISTED_ERRORS, public_text
from tests.service.test_service_api import make_profile, problem

FLOOD_FIELDS = 38_000


def flood(extra: dict[str, Any], num_fields: int = FLOOD_FIELDS) -> bytes:
    """A JSON object of ``extra`` and ``num_fields`` unknown fields (4.6 MB for 38,000)."""
    body = dict(extra)
    for i in range(num_fields):
        body[f"unknown_field_{i:05d}_" + "x" * 96] = i
    return json.dumps(body).encode()


@pytest.fixture
def close_match_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every field a "did you mean" was looked up for (each lookup costs a string match
    against every field of the model)."""
    calls: list[str] = []
    real = difflib.get_close_matches

    def counting(word: str, *args: Any, **kwargs: Any) -> list[str]:
        calls.append(word)
        return real(word, *args, **kwargs)

    monkeypatch.setattr(problems.difflib, "get_close_matches", counting)
    return calls


PLAN = {"effective_batch_size": 64, "max_micro_batch_size": 8}
ROUTES = [
    ("/v1/plan", PLAN, FLOOD_FIELDS),
    ("/v1/probes", {"model": "tiny-mlp"}, FLOOD_FIELDS),
    # A whole profile, and the flood: the unknown fields are all it gets wrong.
    ("/v1/profiles", make_profile().to_dict(), FLOOD_FIELDS),
]


@pytest.mark.parametrize(("path", "known", "num_unknown"), ROUTES, ids=lambda v: str(v)[:12])
def test_a_flood_of_unknown_fields_names_the_first_and_counts_the_rest(
    make_app: Callable[..., FastAPI],
    close_match_calls: list[str],
    path: str,
    known: dict[str, Any],
    num_unknown: int,
) -> None:
    """The issue: 38,000 unknown fields in 4.6 MB cost 3 to 5 s of loop time (a "did you mean"
    each) and answered 8 to 27 MB."""
    client = TestClient(make_app(max_body_bytes=8 << 20))
    raw = flood(known)
    assert len(raw) > 4_500_000
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})

    body = problem(response, 422, "validation")
    assert len(response.content) < 10_000
    listed = body["errors"][:-1]
    assert [error["field"] for error in listed] == [
        f"body.unknown_field_{i:05d}_" + "x" * 96 for i in range(MAX_LISTED_ERRORS)
    ]
    more = num_unknown - MAX_LISTED_ERRORS
    assert body["errors"][-1] == {
        "field": "body",
        "reason": f"{more:,} more errors not listed ({more:,} unknown fields); fix those listed "
        "and send again (the schema is in /openapi.json)",
    }
    assert body["detail"].startswith("body.unknown_field_00000_")
    assert body["detail"].endswith(f"; and {num_unknown - 5:,} more")
    assert len(close_match_calls) <= MAX_LISTED_ERRORS


def test_a_nested_flood_names_its_path(
    make_app: Callable[..., FastAPI], close_match_calls: list[str]
) -> None:
    """Unknown fields inside a nested model (``device``) and in a list of models
    (``profile.trials``) are found where they are."""
    client = TestClient(make_app(max_body_bytes=8 << 20))
    device = json.loads(flood({"capacity_bytes": 2**30}, 20_000))
    response = client.post("/v1/plan", json={**PLAN, "device": device, "surplus": 1})
    errors = problem(response, 422, "validation")["errors"]
    assert errors[0]["field"] == "body.surplus"  # outer first
    assert errors[1]["field"] == "body.device.unknown_field_00000_" + "x" * 96
    assert errors[-1]["reason"].startswith("19,991 more errors not listed (19,991 unknown")
    profile = make_profile().to_dict()
    profile["trials"] = [{**profile["trials"][0], f"extra_{i}": i} for i in range(2_000)]
    response = client.post("/v1/profiles", json=profile)
    errors = problem(response, 422, "validation")["errors"]
    assert [e["field"] for e in errors[:2]] == ["body.trials.0.extra_0", "body.trials.1.extra_1"]
    assert errors[-1]["reason"].startswith("1,990 more errors not listed (1,990 unknown fields)")
    assert len(close_match_calls) <= 2 * MAX_LISTED_ERRORS


def test_the_fields_are_listed_once_per_answer(make_app: Callable[..., FastAPI]) -> None:
    """A few unknown fields (a small body: pydantic reports them all): the first with no field
    like it lists the model's fields; the others say there is none like them."""
    client = TestClient(make_app())
    response = client.post(
        "/v1/plan", content=flood(PLAN, 12), headers={"Content-Type": "application/json"}
    )
    errors = problem(response, 422, "validation")["errors"]
    assert len(errors) == MAX_LISTED_ERRORS + 1
    assert "the fields are" in errors[0]["reason"] and '"world_size"' in errors[0]["reason"]
    assert all(e["reason"].endswith("no field there is like it") for e in errors[1:-1])
    assert errors[-1]["reason"].startswith("2 more errors not listed (2 unknown fields)")


def test_a_flood_of_invalid_values_is_counted_too(make_app: Callable[..., FastAPI]) -> None:
    """Not only unknown fields: 5,000 trials of the wrong type answer 10 and a count."""
    client = TestClient(make_app(max_body_bytes=8 << 20))
    profile = make_profile().to_dict()
    profile["trials"] = [{"micro_batch_size": "many", "fits": "yes"}] * 5_000
    response = client.post("/v1/profiles", json=profile)
    body = problem(response, 422, "validation")
    assert len(body["errors"]) == MAX_LISTED_ERRORS + 1
    assert len(response.content) < 10_000
    reason = body["errors"][-1]["reason"]
    assert reason.startswith(f"{2 * 5_000 - MAX_LISTED_ERRORS:,} more errors not listed (")
    assert "invalid values" in reason


def test_answers_carry_no_server_path(make_app: Callable[..., FastAPI], tmp_path: Path) -> None:
    """The issue: 503 bodies carried the server's absolute store path."""
    app = make_app()
    app.state.service.store.close()
    client = TestClient(app)
    for response in (
        client.get("/v1/profiles"),
        client.post("/v1/profiles", json=make_profile().to_dict()),
        client.post("/v1/plan", json={"profile_id": "ab" * 8, "effective_batch_size": 8}),
    ):
        problem(response, 503, "store-unavailable")
        # The store's failure in words, not its location (which the log has).
        assert str(tmp_path) not in response.text and "it is closed" in response.text
    ready = client.get("/readyz")
    assert ready.status_code == 503 and str(tmp_path) not in ready.text


def test_a_probe_jobs_error_carries_no_server_path() -> None:
    job = ProbeRun(
        id="ab12",
        model="tiny-mlp",
        device="cpu",
        status="failed",
        created_at="2026-12-01T00:00:00+00:00",
        error="StoreError: cannot write /var/lib/autobatch/profiles.sqlite3: disk full",
    )
    assert probe_public(job).error == "StoreError: cannot write <path>: disk full"


@pytest.mark.parametrize(
    ("text", "public"),
    [
        ("the profile store /var/lib/x.sqlite3 is closed", "the profile store <path> is closed"),
        ("cannot open '/tmp/s.sqlite3': disk full", "cannot open '<path>': disk full"),
        ("see http://host:8000/v1/plan and 1/2 of read/write", None),  # no path of the server's
        ("a 3g.40gb slice; GPU-ab/c; ~/.cache", "a 3g.40gb slice; GPU-ab/c; ~<path>"),
    ],
)
def test_public_text_hides_absolute_paths(text: str, public: str | None) -> None:
    assert public_text(text) == (text if public is None else public)


def call_leaving_mid_body(app: FastAPI, path: str, headers: list[tuple[bytes, bytes]]) -> None:
    """One request whose client sends part of its body and leaves."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"effective_batch_size": ', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if len(messages) > 1 else messages[0]

    async def send(_message: dict[str, Any]) -> None:
        pass  # the server drops what is sent to a client that left

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]


def test_a_client_that_leaves_mid_body_is_a_499_not_a_500(
    make_app: Callable[..., FastAPI], caplog: pytest.LogCaptureFixture
) -> None:
    """The issue: a client that disconnected mid-body counted as a 500 with two tracebacks."""
    app = make_app()
    length = [(b"content-length", b"1000")]
    chunked = [(b"transfer-encoding", b"chunked")]
    with caplog.at_level(logging.WARNING):
        for path, headers in [
            ("/v1/plan", length),  # the route reads its own body
            ("/v1/probes", length),  # FastAPI reads a declared body
            ("/v1/profiles", length),
            ("/v1/plan", chunked),  # the middleware buffers it to count its size
        ]:
            call_leaving_mid_body(app, path, headers)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    metrics = TestClient(app).get("/metrics").text
    assert 'status="500"' not in metrics and 'status="400"' not in metrics
    # The one that left while the gate buffered its body counts under its route too.
    for route, count in [("/v1/plan", 2.0), ("/v1/probes", 1.0), ("/v1/profiles", 1.0)]:
        assert f'route="{route}",status="499"}} {count}' in metrics
    assert 'route="unmatched"' not in metrics
