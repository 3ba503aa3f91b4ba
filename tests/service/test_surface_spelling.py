"""One library message, each surface's spelling: a missing NVIDIA driver's fix reads
``device='cpu'`` in Python, ``--device cpu`` on the command line and ``"device": "cpu"`` over
HTTP; a predicted plan's note names ``autobatch.autotune`` in Python, ``autobatch tune`` on the
command line and ``POST /v1/probes`` over HTTP. And a profile's model by name over HTTP."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch import device as device_face
from autobatch.cli import main as cli_main
from autobatch.device._nvml import Nvml
from autobatch.errors import DeviceUnavailableError
from autobatch.store import ProfileStore
from tests.helpers.fake_pynvml import ERROR_CLASSES, FakePynvml
from tests.planning.test_planner import plan
from tests.planning.test_prediction import UNIT, issue_profile
from tests.service.conftest import no_nvml

NO_GPU = {
    "python": "use device='cpu' or 'sim:SIZE' (on a machine without a GPU)",
    "cli": "use device cpu or sim:SIZE (on a machine without a GPU)",  # devices has no --device
    "http": 'use "device": "cpu" or "sim:SIZE" (on a machine without a GPU)',
}


def _no_driver_error() -> DeviceUnavailableError:
    with pytest.raises(DeviceUnavailableError) as raised:
        no_nvml().list_gpus()
    return raised.value


def test_no_driver_reads_in_python_spelling_in_the_library() -> None:
    error = _no_driver_error()
    assert error.reason == "driver_not_loaded"
    assert str(error).endswith(NO_GPU["python"])
    assert "--device" not in str(error)


def test_no_driver_reads_in_flags_on_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_library = FakePynvml([], init_errors=[ERROR_CLASSES["NVMLError_LibraryNotFound"]()])
    monkeypatch.setattr(device_face._nvml, "default_nvml", lambda: Nvml(no_library, environ={}))
    assert cli_main(["devices"]) == 1
    err = capsys.readouterr().err
    assert "libnvidia-ml.so.1 was not found" in err
    assert err.rstrip().endswith(NO_GPU["cli"]) and "device=" not in err


def test_no_driver_reads_in_fields_over_http(make_app: Callable[..., FastAPI]) -> None:
    client = TestClient(make_app(nvml=no_nvml()))
    listed = client.get("/v1/devices").json()
    assert listed["reason"] == "driver_not_loaded"
    assert listed["detail"].endswith(NO_GPU["http"]) and "--device" not in listed["detail"]
    ready = client.get("/readyz").json()
    assert ready["nvml_reason"] == "driver_not_loaded"
    assert ready["nvml_detail"].endswith(NO_GPU["http"])


PREDICTED = "one real trial on that card confirms it ({})"


def test_a_predicted_plan_names_each_surface_s_way_to_confirm_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_app: Callable[..., FastAPI]
) -> None:
    profile = issue_profile()
    python = plan(profile, effective_batch_size=64, capacity_bytes=24 * UNIT)
    assert python.notes[-1].endswith(PREDICTED.format("autobatch.autotune there does"))

    store = tmp_path / "profiles.sqlite3"
    with ProfileStore(store) as opened:
        profile_id = opened.put(profile)
    argv = ["--store", str(store), "plan", "--profile", profile_id]
    assert cli_main([*argv, "--effective-batch-size", "64", "--capacity", str(24 * UNIT)]) == 0
    out = capsys.readouterr().out
    assert PREDICTED.format("autobatch tune there does") in out
    assert "autobatch.autotune" not in out

    app = make_app()
    app.state.service.store.put(profile)
    body = {"profile_id": profile_id, "effective_batch_size": 64}
    body["device"] = {"capacity_bytes": 24 * UNIT}
    answer = TestClient(app).post("/v1/plan", json=body)
    assert answer.status_code == 200, answer.text
    notes = answer.json()["plan"]["notes"]
    assert any(PREDICTED.format("POST /v1/probes there does") in note for note in notes), notes
    assert not any("autobatch.autotune" in note for note in notes)


def test_get_profiles_serves_the_model_name_and_an_old_profile_none(client: TestClient) -> None:
    import dataclasses

    from tests.service.test_service_api import make_profile

    named = dataclasses.replace(make_profile(), model_name="gpt2")
    old = make_profile(node_name="older-node").to_dict()
    del old["model_name"]
    old["schema_version"] = 3  # before names were recorded
    ids = {
        client.post("/v1/profiles", json=named.to_dict()).json()["id"]: "gpt2",
        client.post("/v1/profiles", json=old).json()["id"]: "",
    }
    listed = client.get("/v1/profiles").json()["profiles"]
    assert {p["id"]: p["profile"]["model_name"] for p in listed} == ids
    summaries = client.get("/v1/profile-summaries").json()["summaries"]
    assert {s["id"]: s["model_name"] for s in summaries} == ids
