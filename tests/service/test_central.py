"""Node mode feeding a central service: a node's sidecar publishes what its probe runs find, and
the central service plans from it by card type."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.profile import Profile
from autobatch.store import ProfileStore
from service.fleet.publisher import OutboxPolicy, Publisher
from service.web.metrics import Metrics
from tests.service.serving import free_port, serving
from tests.service.test_publish import FlakyServer
from tests.service.test_service_api import make_profile


def test_publisher_sends_each_profile_and_counts_outcomes(
    flaky: FlakyServer, tmp_path: Path
) -> None:
    # the first profile is retried, after the others (a failed row waits its backoff; the rest
    # are not held behind it): node-1 is taken, node-2 refused, node-0 taken on its second try
    flaky.script = ["503", "ok", "422"]
    metrics = Metrics()
    policy = OutboxPolicy(base_delay_seconds=0.01, max_delay_seconds=0.02)
    first, second, third = (make_profile(node_name=f"node-{i}") for i in range(3))
    with ProfileStore(tmp_path / "node.sqlite3") as store:
        publisher = Publisher(flaky.url, token=None, store=store, policy=policy, metrics=metrics)
        for profile in (first, second, third):
            publisher.submit(profile)
        publisher.open()
        deadline = time.monotonic() + 30
        while store.outbox.count() and time.monotonic() < deadline:
            time.sleep(0.05)
        publisher.close(timeout_seconds=10)
        assert store.outbox.count() == 0

    nodes = [Profile.from_dict(json.loads(b)).node_name for b in flaky.bodies]
    assert nodes == ["node-0", "node-1", "node-2", "node-0"]
    text = metrics.render(list).decode()
    for outcome, count in (("published", 2), ("retried", 1), ("refused", 1)):
        assert f'autobatch_profiles_published_total{{outcome="{outcome}"}} {count}.0' in text


def _wait(predicate: Any, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.mark.slow
def test_a_probe_on_a_node_answers_a_plan_by_card_at_the_central_service(
    tmp_path: Path, registry_file: Path
) -> None:
    (tmp_path / "central").mkdir()
    (tmp_path / "node").mkdir()
    with serving(tmp_path / "central") as central:
        central_url = f"http://127.0.0.1:{central.port}"
        with serving(
            tmp_path / "node",
            "--config-file",
            str(registry_file),
            "--central-url",
            central_url,
        ) as node:
            job = node.client.post("/v1/probes", json={"model": "tiny-mlp"}).json()
            done = _wait(
                lambda: (
                    body
                    if (body := node.client.get(f"/v1/probes/{job['id']}").json())["status"]
                    in ("succeeded", "failed")
                    else None
                ),
                "the probe run",
            )
            assert done["status"] == "succeeded", done["error"]
            profile = Profile.from_dict(done["profile"])
            published = _wait(
                lambda: central.client.get("/v1/profiles").json()["profiles"],
                "the profile at the central service",
                timeout=30,
            )
            assert Profile.from_dict(published[0]["profile"]) == profile
            # The publisher counts the profile once central's answer is read, which may come
            # after central lists it.
            published_once = 'autobatch_profiles_published_total{outcome="published"} 1.0'
            _wait(
                lambda: published_once in node.client.get("/metrics").text,
                "the publisher's count",
                timeout=30,
            )

        answer = central.client.post(
            "/v1/plan",
            json={
                "model_fingerprint": profile.model_fingerprint,
                "card": profile.device_name,
                "effective_batch_size": 2 * profile.recommended_micro_batch_size,
            },
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["selection"]["match"] == "measured"
        assert body["selection"]["node_name"] == profile.node_name != ""
        assert body["selection"]["profile_id"] == published[0]["id"]
        assert body["plan"]["gradient_accumulation_steps"] == 2

        # Node B never probed this model: its sidecar answers from the central service's profile.
        (tmp_path / "node-b").mkdir()
        with serving(tmp_path / "node-b", "--central-url", central_url) as node_b:
            plan_b = node_b.client.post(
                "/v1/plan",
                json={
                    "model_fingerprint": profile.model_fingerprint,
                    "effective_batch_size": 2 * profile.recommended_micro_batch_size,
                },
            )
            assert plan_b.status_code == 200, plan_b.text
            assert plan_b.json()["plan"]["micro_batch_size"] == profile.recommended_micro_batch_size
            assert plan_b.json()["plan"]["source"] == "cached"
            by_card_b = node_b.client.post(
                "/v1/plan",
                json={
                    "model_fingerprint": profile.model_fingerprint,
                    "card": profile.device_name,
                    "effective_batch_size": 2 * profile.recommended_micro_batch_size,
                },
            )
            assert by_card_b.status_code == 200, by_card_b.text
            assert by_card_b.json()["selection"]["match"] == "measured"
            assert by_card_b.json()["selection"]["node_name"] == profile.node_name
            # It kept a copy: the profile answers from node B's own store.
            kept = node_b.client.get(f"/v1/profiles/{plan_b.json()['profile_id']}")
            assert Profile.from_dict(kept.json()["profile"]) == profile


def test_a_sidecar_whose_central_service_is_down_answers_from_its_own_store(
    make_app: Callable[..., FastAPI],
) -> None:
    app = make_app(central_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    answer = TestClient(app).post(
        "/v1/plan", json={"model_fingerprint": "abc", "effective_batch_size": 8}
    )
    assert answer.status_code == 404
    assert "no stored profile has model_fingerprint 'abc'" in answer.json()["detail"]
