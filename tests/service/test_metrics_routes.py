"""Requests are counted under their route's template, also when the gate answered them before
the route ran (a 401) and for FastAPI's own pages; only a path no route has is "unmatched"."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.testclient import TestClient


def count(metrics: str, method: str, route: str, status: int) -> float:
    prefix = (
        f'autobatch_http_requests_total{{method="{method}",route="{route}",status="{status}"}} '
    )
    (line,) = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


def test_a_refused_request_and_the_docs_are_labelled_by_their_route(
    make_app: Callable[..., FastAPI],
) -> None:
    client = TestClient(make_app(api_token="s3cret"))
    plan = {"max_micro_batch_size": 8, "effective_batch_size": 16}
    assert client.post("/v1/plan", json=plan).status_code == 401
    assert client.get("/v1/profiles/feedbeef").status_code == 401
    for page in ("/docs", "/openapi.json", "/redoc"):
        assert client.get(page).status_code == 200
    assert client.get("/no/such/page").status_code == 404
    assert client.get("/v1/no-such-route").status_code == 401  # the gate answers all of /v1
    assert client.delete("/healthz").status_code == 405
    metrics = client.get("/metrics").text
    assert count(metrics, "POST", "/v1/plan", 401) == 1.0
    assert count(metrics, "GET", "/v1/profiles/{profile_id}", 401) == 1.0
    for page in ("/docs", "/openapi.json", "/redoc"):
        assert count(metrics, "GET", page, 200) == 1.0
    assert count(metrics, "GET", "unmatched", 404) == 1.0
    assert count(metrics, "GET", "unmatched", 401) == 1.0
    assert count(metrics, "DELETE", "/healthz", 405) == 1.0
    assert 'route="unmatched",status="200"' not in metrics
