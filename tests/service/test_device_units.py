"""The service's probes refuse a simulated device's size without its unit (``sim:3``), as the
library does (tests/device/test_capacity_units.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient


def test_the_service_refuses_a_probe_device_without_its_unit(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    client = TestClient(make_app(config_file=registry_file))
    response = client.post("/v1/probes", json={"model": "tiny-mlp", "device": "sim:3"})
    assert response.status_code == 422
    (error,) = response.json()["errors"]
    assert error["field"] == "body.device" and "did you mean 'sim:3GiB'?" in error["reason"]
    assert client.get("/v1/probes").json()["probes"] == []
