"""Service fixtures: an app over a temporary store, a fake at the NVML boundary, a client."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device._nvml import Nvml
from service.main import create_app
from service.web.settings import Settings
from tests.helpers.fake_pynvml import ERROR_CLASSES, FakeGpu, FakePynvml, GiB
from tests.service.models import REGISTRY_TOML

if TYPE_CHECKING:
    from tests.service.test_publish import FlakyServer

A100_UUID = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
H100_UUID = "GPU-9f8e7d6c-0000-1111-2222-333344445555"


def two_gpus() -> list[FakeGpu]:
    """An 80 GiB A100 (79 GiB free) and a 94 GiB H100 (90 GiB free)."""
    return [
        FakeGpu(uuid=A100_UUID, name="NVIDIA A100-SXM4-80GB", total=80 * GiB, free=79 * GiB),
        FakeGpu(uuid=H100_UUID, name="NVIDIA H100 NVL", total=94 * GiB, free=90 * GiB),
    ]


def fake_gpus() -> Nvml:
    """NVML over a fake pynvml with :func:`two_gpus`, no visible-device variables set."""
    return Nvml(FakePynvml(two_gpus()), environ={})


def no_nvml() -> Nvml:
    """NVML on a machine without the NVIDIA kernel driver: every initialisation fails."""
    return Nvml(FakePynvml([], init_error=ERROR_CLASSES["NVMLError_DriverNotLoaded"]), environ={})


@pytest.fixture
def registry_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(REGISTRY_TOML)
    return path


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[Callable[..., FastAPI]]:
    """``make_app(nvml=..., **settings)``: an app on a fresh store, NVML faked."""
    apps: list[FastAPI] = []

    def make(nvml: Nvml | None = None, **settings: Any) -> FastAPI:
        settings.setdefault("store_path", str(tmp_path / f"store{len(apps)}.sqlite3"))
        app = create_app(Settings(**settings), nvml=nvml or fake_gpus())
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.state.service.runs.close()
        app.state.service.store.close()


@pytest.fixture
def client(make_app: Callable[..., FastAPI]) -> TestClient:
    return TestClient(make_app())


@pytest.fixture
def flaky() -> Iterator[FlakyServer]:
    """A local HTTP server that answers a scripted run of failures and successes (test_publish)."""
    from tests.service.test_publish import FlakyServer

    server = FlakyServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()
