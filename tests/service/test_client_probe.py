"""``AutobatchClient.start_probe`` and ``wait_for_probe`` against the service's probe routes
(``POST /v1/probes``, ``GET /v1/probes/{id}``), in-process: the way docs/service.md shows to run
a registered model's probe and wait for its profile."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI

from autobatch.client._http import ServiceError
from tests.service.test_client import client_for


@pytest.mark.slow  # a spawned probe child importing torch
def test_wait_for_probe_returns_the_finished_job_with_its_profile(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    app = make_app(config_file=registry_file)
    api = client_for(app)
    done = api.wait_for_probe(api.start_probe("tiny-mlp"), timeout_seconds=120, poll_seconds=0.1)
    assert done.status == "succeeded", done.error
    assert done.model == "tiny-mlp" and not done.cached
    assert done.profile is not None and done.profile_id is not None
    assert done.num_trials >= 2
    assert done.largest_fitting_micro_batch_size == done.profile.max_micro_batch_size
    assert app.state.service.store.get(done.profile_id) == done.profile


def test_wait_for_probe_gives_up_after_its_timeout_naming_the_job(
    make_app: Callable[..., FastAPI], registry_file: Path
) -> None:
    api = client_for(make_app(config_file=registry_file))
    probe_id = api.start_probe("slow-mlp")  # builds its model for a minute
    started = time.monotonic()
    with pytest.raises(ServiceError, match=rf"probe job {probe_id} still (queued|running) after"):
        api.wait_for_probe(probe_id, timeout_seconds=0.3, poll_seconds=0.1)
    assert time.monotonic() - started < 10
