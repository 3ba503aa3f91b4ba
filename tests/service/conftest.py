"""Service fixtures: an app over a temporary store, a fake at the NVML boundary, a client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device import GpuInfo
from autobatch.device.nvml import Nvml
from autobatch.errors import DeviceUnavailableError
from service.main import create_app
from service.settings import Settings
from tests.service.models import REGISTRY_TOML
from tests.unit.fake_pynvml import FakeGpu, FakePynvml, GiB

A100_UUID = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
H100_UUID = "GPU-9f8e7d6c-0000-1111-2222-333344445555"


def fake_gpus() -> Callable[[], list[GpuInfo]]:
    """Two GPUs behind a fake pynvml: an 80 GiB A100 (79 GiB free) and a 94 GiB H100."""
    fake = FakePynvml(
        [
            FakeGpu(uuid=A100_UUID, name="NVIDIA A100-SXM4-80GB", total=80 * GiB, free=79 * GiB),
            FakeGpu(uuid=H100_UUID, name="NVIDIA H100 NVL", total=94 * GiB, free=90 * GiB),
        ]
    )
    return Nvml(fake, environ={}).list_gpus


def no_nvml() -> list[GpuInfo]:
    raise DeviceUnavailableError("NVML is not available: no NVIDIA driver (test)")


@pytest.fixture
def registry_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(REGISTRY_TOML)
    return path


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[Callable[..., FastAPI]]:
    """``make_app(list_gpus=..., **settings)``: an app on a fresh store, NVML faked."""
    apps: list[FastAPI] = []

    def make(list_gpus: Callable[[], list[GpuInfo]] | None = None, **settings: Any) -> FastAPI:
        settings.setdefault("store_path", str(tmp_path / f"store{len(apps)}.sqlite3"))
        app = create_app(Settings(**settings), list_gpus=list_gpus or fake_gpus())
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.state.service.jobs.close()
        app.state.service.store.close()


@pytest.fixture
def client(make_app: Callable[..., FastAPI]) -> TestClient:
    return TestClient(make_app())
