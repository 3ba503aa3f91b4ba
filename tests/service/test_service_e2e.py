"""The real server (``autobatch serve``) on a loopback port: a probe run of a registered model on
the simulated device, a job whose child is killed, and ``autotune(report_to=...)``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from autobatch.profile import Profile

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # the real server in a subprocess, probe children importing torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def server(tmp_path: Path, registry_file: Path) -> Iterator[httpx.Client]:
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    # As the README starts it: the console script, no PYTHONPATH. The registry's factories
    # (tests.service.models) are then found only because the server adds its working directory.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["AUTOBATCH_API_TOKEN"] = "e2e-token"
    script = Path(sys.executable).with_name("autobatch")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "autobatch"]
    process = subprocess.Popen(
        [
            *command,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--store-path",
            str(tmp_path / "store.sqlite3"),
            "--config-file",
            str(registry_file),
            "--probe-timeout-seconds",
            "120",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": "Bearer e2e-token"},
        timeout=10,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                output = (tmp_path / "server.log").read_text()
                pytest.fail(f"server did not start (exit {process.poll()}): {output}")
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)
        try:
            # uvicorn shuts down gracefully, then re-raises the signal it caught.
            assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()


def wait_for(client: httpx.Client, job_id: str, statuses: set[str], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/probes/{job_id}").json()
        if body["status"] in statuses:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def test_probe_job_end_to_end_and_a_killed_child(server: httpx.Client) -> None:
    assert (
        server.post(
            "/v1/probes", json={"model": "tiny-mlp"}, headers={"Authorization": ""}
        ).status_code
        == 401
    )
    started = server.post("/v1/probes", json={"model": "tiny-mlp"})
    assert started.status_code == 202, started.text
    done = wait_for(server, started.json()["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    profile = Profile.from_dict(done["profile"])
    assert profile.device_type == "sim" and profile.total_memory_bytes == 8 * 2**20
    assert profile.max_micro_batch_size >= 1 and profile.num_trials >= 2
    assert done["progress"]["num_trials"] == profile.num_trials
    assert done["progress"]["largest_fitting_micro_batch_size"] == profile.max_micro_batch_size
    stored = server.get(f"/v1/profiles/{done['profile_id']}").json()
    assert Profile.from_dict(stored["profile"]) == profile
    plan = server.post(
        "/v1/plan",
        json={
            "profile_id": done["profile_id"],
            "effective_batch_size": profile.max_micro_batch_size * 3,
        },
    ).json()["plan"]
    assert plan["gradient_accumulation_steps"] == 3 and plan["source"] == "cached"

    slow = server.post("/v1/probes", json={"model": "slow-mlp"}).json()
    running = wait_for(server, slow["id"], {"running"})
    deadline = time.monotonic() + 30
    while running["child_pid"] is None and time.monotonic() < deadline:
        running = server.get(f"/v1/probes/{slow['id']}").json()
    os.kill(running["child_pid"], signal.SIGKILL)
    failed = wait_for(server, slow["id"], {"succeeded", "failed"})
    assert failed["status"] == "failed"
    assert "killed by SIGKILL" in failed["error"]
    assert server.get("/healthz").status_code == 200
    metrics = server.get("/metrics").text
    assert 'autobatch_probe_jobs_total{event="succeeded"} 1.0' in metrics
    assert 'autobatch_probe_jobs_total{event="failed"} 1.0' in metrics
    assert f"autobatch_probe_ooms_total {float(profile.num_ooms)}" in metrics


def test_autotune_reports_a_new_profile_to_the_service(
    server: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import autobatch

    monkeypatch.setenv("AUTOBATCH_API_TOKEN", "e2e-token")
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    sample = (torch.randn(2, 16), torch.randint(0, 4, (2,)))
    plan = autobatch.autotune(
        model,
        sample,
        effective_batch_size=64,
        loss_fn=torch.nn.functional.cross_entropy,
        device="sim:2MiB",
        use_store=False,
        report_to=str(server.base_url),
    )
    items = server.get("/v1/profiles").json()["profiles"]
    fingerprint = autobatch.probing._identity.model_fingerprint(model)
    matching = [p for p in items if p["profile"]["model_fingerprint"] == fingerprint]
    assert len(matching) == 1
    assert matching[0]["profile"]["recommended_micro_batch_size"] == plan.max_micro_batch_size


@pytest.mark.slow  # the server, a probe on a small card, then the confirmation
def test_autotune_confirms_a_plan_predicted_from_a_profile_the_service_holds(
    server: httpx.Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch

    import autobatch
    from autobatch.tuning import autotune_profile

    monkeypatch.setenv("AUTOBATCH_API_TOKEN", "e2e-token")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    sample = (torch.randn(2, 16), torch.randint(0, 4, (2,)))
    step: dict[str, Any] = {"loss_fn": torch.nn.functional.cross_entropy}
    small = autotune_profile(model, sample, device="sim:2MiB", use_store=False, **step).profile
    assert "id" in server.post("/v1/profiles", json=small.to_dict()).json()
    predicted = autobatch.plan(small, effective_batch_size=1, capacity_bytes=8 * 2**20)
    assert predicted.source == "predicted"

    # A card of another size, an empty local store: the service's profile predicts, one trial
    # confirms, and the service gets the confirming profile.
    plan = autobatch.autotune(
        model,
        sample,
        # Above the predicted max: autotune never tries past ceil(E / world_size), so a smaller
        # E would confirm that cap instead of the prediction.
        effective_batch_size=16384,
        device="sim:8MiB",
        store=tmp_path / "local.sqlite3",
        report_to=str(server.base_url),
        **step,
    )
    assert plan.source == "measured"
    assert plan.max_micro_batch_size == predicted.max_micro_batch_size
    items = server.get("/v1/profiles").json()["profiles"]
    confirmed = [p["profile"] for p in items if p["profile"]["stop_reason"].startswith("confirm")]
    assert len(confirmed) == 1
    assert confirmed[0]["max_micro_batch_size"] == predicted.max_micro_batch_size
