"""A real ``autobatch serve`` whose NVML hangs, then loses a card, then recovers: the fake pynvml
(``tests/service/fake_nvml``) is what the server imports, steered through a control file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.fake_pynvml import GiB
from tests.service.conftest import A100_UUID, H100_UUID
from tests.service.test_service_e2e import ROOT, free_port

pytestmark = pytest.mark.slow

NVML_TIMEOUT_S = 1.5
HANG_S = 6.0
GPUS = [
    {"uuid": A100_UUID, "name": "NVIDIA A100-SXM4-80GB", "total": 80 * GiB, "free": 79 * GiB},
    {"uuid": H100_UUID, "name": "NVIDIA H100 NVL", "total": 94 * GiB, "free": 90 * GiB},
]
GPU_PLAN = {
    "memory_model": {"fixed_bytes": 0, "bytes_per_sample": GiB},
    "device": {"cuda_index": 0},
    "effective_batch_size": 8,
}
NVML_FREE_PLAN = {"max_micro_batch_size": 8, "effective_batch_size": 16}


class Control:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.set()

    def set(self, **fields: Any) -> None:
        self.path.write_text(json.dumps({"gpus": GPUS, **fields}))


@pytest.fixture
def control(tmp_path: Path) -> Control:
    return Control(tmp_path / "nvml.json")


@pytest.fixture
def server(tmp_path: Path, control: Control) -> Iterator[httpx.Client]:
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "service" / "fake_nvml"), str(ROOT)]),
        "AUTOBATCH_FAKE_NVML": str(control.path),
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autobatch",
            "serve",
            "--port",
            str(port),
            "--store-path",
            ":memory:",
            "--nvml-timeout-seconds",
            str(NVML_TIMEOUT_S),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # Every request gets less than the hang: a service waiting on NVML inline fails here.
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG_S - 1)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start: {(tmp_path / 'server.log').read_text()}")
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()


def slug(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json", response.text
    return str(response.json()["type"]).removeprefix("urn:autobatch:problem:")


def test_hung_nvml_never_freezes_the_server_and_it_recovers(
    server: httpx.Client, control: Control
) -> None:
    assert server.post("/v1/plan", json=GPU_PLAN).status_code == 200  # the fake is in use
    assert server.get("/v1/devices").json()["devices"][0]["uuid"] == A100_UUID

    control.set(memory_delay_s={A100_UUID: HANG_S})
    time.sleep(1.2)  # the cached reading (max age 1 s) is stale: the next plan must sample
    hung: dict[str, httpx.Response] = {}
    waiting = threading.Thread(
        target=lambda: hung.update(plan=server.post("/v1/plan", json=GPU_PLAN))
    )
    waiting.start()
    time.sleep(0.3)  # the plan now waits on the hung card; the rest must answer meanwhile
    assert server.get("/healthz").status_code == 200
    assert server.post("/v1/plan", json=NVML_FREE_PLAN).status_code == 200
    waiting.join()
    assert hung["plan"].status_code == 503 and slug(hung["plan"]) == "nvml_timeout"
    ready = server.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["gpu_problems"][0]["reason"] == "nvml_timeout"
    assert server.get("/metrics").status_code == 200
    h100 = dict(GPU_PLAN, device={"cuda_index": 1})
    assert server.post("/v1/plan", json=h100).status_code == 200

    control.set()  # the driver answers again once the hung call returns: no restart
    deadline = time.monotonic() + HANG_S + 10
    while server.post("/v1/plan", json=GPU_PLAN).status_code != 200:
        assert time.monotonic() < deadline, "the service did not recover"
        time.sleep(0.3)
    assert server.get("/readyz").status_code == 200

    control.set(memory_error={A100_UUID: "NVMLError_GpuIsLost"})
    time.sleep(1.2)
    lost = server.post("/v1/plan", json=GPU_PLAN)
    assert lost.status_code == 503 and slug(lost) == "gpu_lost"
    assert server.get("/readyz").json()["gpu_problems"][0]["reason"] == "gpu_lost"
