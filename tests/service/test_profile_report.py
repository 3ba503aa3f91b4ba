"""GET /v1/profiles/{id}/report: the data of ``tune --report``'s page for a stored profile (issue
45: "the service can return the same data as JSON"), drawn by the same functions."""

from __future__ import annotations

from fastapi.testclient import TestClient

from autobatch.planning import mode_report
from autobatch.profile import Trial
from tests.service.test_service_api import GiB, make_profile, problem


def test_a_profiles_report_lists_its_real_trials_and_its_recommended_point(
    client: TestClient,
) -> None:
    profile = make_profile(
        activation_checkpointing="full",
        trials=(
            Trial(micro_batch_size=1, fits=True, peak_allocated_bytes=3 * GiB, warm_up=True),
            Trial(micro_batch_size=32, fits=True, peak_allocated_bytes=20 * GiB, step_seconds=0.8),
            Trial(micro_batch_size=48, fits=False, oom=True, error="OutOfMemoryError"),
        ),
    )
    created = client.post("/v1/profiles", json=profile.to_dict())
    assert created.status_code == 201, created.text
    report = client.get(f"/v1/profiles/{created.json()['id']}/report")
    assert report.status_code == 200, report.text
    body = report.json()
    assert body["capacity_bytes"] == 40 * GiB
    (mode,) = body["modes"]
    assert mode["mode"] == "full"
    # The warm-up is left out; the OOM has no peak and no time; 0.8 s over 32 samples.
    assert mode["trials"] == [
        {"micro_batch_size": 32, "fits": True, "oom": False, "peak_memory_bytes": 20 * GiB,
         "seconds_per_sample": 0.025},
        {"micro_batch_size": 48, "fits": False, "oom": True, "peak_memory_bytes": None,
         "seconds_per_sample": None},
    ]  # fmt: skip
    # The recommended 36 on the line 4 GiB + 0.5 GiB a sample: 22 GiB.
    assert body["chosen"] == {
        "activation_checkpointing": "full",
        "micro_batch_size": 36,
        "gradient_accumulation_steps": None,
        "predicted_peak_memory_bytes": 22 * GiB,
    }
    assert body["why"] == []
    # The library's page draws each mode from the same function.
    assert mode == mode_report("full", profile)


def test_the_report_of_an_unknown_profile_is_404(client: TestClient) -> None:
    body = problem(client.get("/v1/profiles/0123456789abcdef/report"), 404, "unknown-profile")
    assert "0123456789abcdef" in body["detail"]
