"""Which profile speaks for a card: two nodes publish the same model on one H100, a
whole card and a time-sliced 22 GiB share, beside a newer L40S profile; POST /v1/plan answers
the same whatever the publish order, for the card in any of its name forms, on SQLite and on
PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device import BudgetReading, BudgetSource, MemoryBudget, combine_budget
from autobatch.profile import Profile, Trial
from service.plans.schemas import PlanPublic
from tests.helpers.fake_pynvml import GiB
from tests.service.conftest import no_nvml
from tests.service.test_service_api import make_profile, problem

H100, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L40S"
LABEL = "NVIDIA-H100-80GB-HBM3"


def budget(total: int, *limits: tuple[BudgetSource, int]) -> MemoryBudget:
    """A probe's budget on a card of ``total`` bytes (1 GiB held by the driver and context),
    with ``limits`` (source, bytes) below it."""
    card = BudgetReading(
        source="nvml", total_bytes=total, available_bytes=total - GiB, free_bytes=total - GiB
    )
    return combine_budget(
        [card, *(BudgetReading(source=s, total_bytes=b, available_bytes=b) for s, b in limits)]
    )


def trials(largest_fit: int, failed: int) -> tuple[Trial, ...]:
    """4 GiB + 0.5 GiB per sample (make_profile's memory model), the warm-up at 1."""
    return (
        Trial(micro_batch_size=1, fits=True, peak_allocated_bytes=4 * GiB + GiB // 2, warm_up=True),
        Trial(
            micro_batch_size=largest_fit,
            fits=True,
            peak_allocated_bytes=4 * GiB + largest_fit * GiB // 2,
            peak_reserved_bytes=4 * GiB + largest_fit * GiB // 2,
        ),
        Trial(micro_batch_size=failed, fits=False, oom=True, error="OutOfMemoryError"),
    )


WHOLE = make_profile(
    device_name=H100,
    node_name="node-whole",
    max_micro_batch_size=40,
    recommended_micro_batch_size=32,
    trials=trials(32, 48),
    capacity_bytes=79 * GiB,
    budget=budget(80 * GiB),
)
SHARE = make_profile(
    device_name=H100,
    node_name="node-shared",
    max_micro_batch_size=8,
    recommended_micro_batch_size=8,
    trials=trials(8, 12),
    capacity_bytes=22 * GiB,
    budget=budget(80 * GiB, ("time_slicing", 22 * GiB)),
)
NEWEST_L40S = make_profile(
    device_name=L40S,
    node_name="node-l",
    max_micro_batch_size=64,
    recommended_micro_batch_size=64,
    trials=trials(64, 80),
    total_memory_bytes=48 * GiB,
    capacity_bytes=47 * GiB,
    budget=budget(48 * GiB),
)


@pytest.fixture(params=["sqlite", "postgres"])
def store_client(request: pytest.FixtureRequest, make_app: Callable[..., FastAPI]) -> TestClient:
    """A central service (no NVML) on a fresh SQLite file or PostgreSQL database."""
    settings: dict[str, Any] = {}
    if request.param == "postgres":
        settings["store_path"] = request.getfixturevalue("postgres_url")
    return TestClient(make_app(nvml=no_nvml(), **settings))


def publish(client: TestClient, *profiles: Profile) -> list[str]:
    ids = []
    for profile in profiles:
        response = client.post("/v1/profiles", json=profile.to_dict())
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    return ids


def plan(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/plan", json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 128, **body}
    )
    assert response.status_code == 200, response.text
    PlanPublic.model_validate(response.json())
    answer: dict[str, Any] = response.json()
    return answer


def split(answer: dict[str, Any]) -> tuple[int, int]:
    return answer["plan"]["micro_batch_size"], answer["plan"]["gradient_accumulation_steps"]


@pytest.mark.parametrize("order", [1, -1], ids=["share-last", "whole-last"])
def test_the_card_answers_from_the_whole_card_and_the_shared_node_from_its_share(
    store_client: TestClient, order: int
) -> None:
    whole_id, share_id = publish(store_client, *[WHOLE, SHARE][::order])[::order]
    publish(store_client, NEWEST_L40S)

    for card in (H100, LABEL, "H100 80GB HBM3", "H100-80GB-HBM3", f"{LABEL}-SHARED"):
        by_card = plan(store_client, card=card)
        assert split(by_card) == (32, 4), card
        selection = by_card["selection"]
        assert (selection["match"], selection["profile_id"]) == ("measured", whole_id)
        assert selection["considered"] == [whole_id]  # the share never agrees with a whole card
        assert (selection["card"], selection["device_name"]) == (card, H100)
    by_node = plan(store_client, node="node-shared")
    assert split(by_node) == (8, 16)
    assert (by_node["selection"]["match"], by_node["selection"]["profile_id"]) == (
        "measured",
        share_id,
    )
    assert split(plan(store_client, node="node-whole")) == (32, 4)


def test_a_card_in_label_form_with_a_device_plans_from_that_card(
    store_client: TestClient,
) -> None:
    whole_id, _ = publish(store_client, WHOLE, SHARE)
    publish(store_client, NEWEST_L40S)

    sized = plan(store_client, card=LABEL, device={"capacity_bytes": 80 * GiB})
    assert (sized["selection"]["match"], sized["selection"]["profile_id"]) == ("measured", whole_id)
    assert split(sized) == (32, 4)  # not 64 x 2 from the L40S
    labels = {"nvidia.com/gpu.product": LABEL, "nvidia.com/gpu.memory": "81559"}
    labelled = plan(store_client, card=LABEL, device={"node_labels": labels})
    assert labelled["selection"]["profile_id"] == whole_id
    assert labelled["selection"]["match"] == "measured"
    assert split(labelled) == (32, 4)


def test_a_share_asked_answers_from_the_agreeing_share_or_the_whole_card_scaled(
    store_client: TestClient,
) -> None:
    whole_id, share_id = publish(store_client, WHOLE, SHARE)

    # Four replicas of an 88 GiB card: 22 GiB each, the share that was measured.
    quarter = {"nvidia.com/gpu.memory": "90112", "nvidia.com/gpu.replicas": "4"}
    shared = plan(store_client, card=LABEL, device={"node_labels": quarter})
    assert (shared["selection"]["match"], shared["selection"]["profile_id"]) == (
        "measured",
        share_id,
    )
    assert split(shared) == (8, 16)
    # Two replicas of an 80 GiB card: 40 GiB, measured by no share; the whole card's profile
    # planned for 40 GiB, predicted, and it says so.
    half = {"nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.replicas": "2"}
    scaled = plan(store_client, card=H100, device={"node_labels": half})
    selection = scaled["selection"]
    assert (selection["match"], selection["profile_id"]) == ("predicted", whole_id)
    assert selection["reasons"] == [
        "measured on the whole card (79.00 GiB), planned for a share of 40.00 GiB"
    ]
    assert scaled["plan"]["capacity_bytes"] == 40 * GiB
    # 4 GiB + 0.5 GiB per sample within 40 GiB x 0.95 reaches past the 32 measured, but the
    # whole card's search found its maximum at 40 (41 did not fit its 40 GiB capacity; 48 ran
    # out of memory): 40 at most on a share no larger, and 128 = 32 x 4.
    assert (scaled["plan"]["max_micro_batch_size"], split(scaled)) == (40, (32, 4))
    assert any(note.startswith(f"predicted for {H100}") for note in scaled["plan"]["notes"])


def test_only_shares_measured_never_answer_a_whole_card(store_client: TestClient) -> None:
    publish(store_client, SHARE)

    response = store_client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "card": LABEL, "effective_batch_size": 128},
    )

    body = problem(response, 404, "unknown-profile")
    assert "a share never answers for a whole card" in body["detail"]
    assert f"card {LABEL!r}" in body["detail"]


def test_agreeing_nodes_answer_the_most_conservative_whatever_the_order(
    store_client: TestClient,
) -> None:
    other = make_profile(
        device_name=H100,
        node_name="node-other",
        max_micro_batch_size=48,
        recommended_micro_batch_size=44,
        trials=trials(44, 52),
        capacity_bytes=79 * GiB,
        budget=budget(80 * GiB),
    )
    other_id, whole_id = publish(store_client, other, WHOLE)

    answer = plan(store_client, card=LABEL)

    selection = answer["selection"]
    assert (selection["profile_id"], split(answer)) == (whole_id, (32, 4))
    assert selection["considered"] == sorted([other_id, whole_id])
    assert selection["max_micro_batch_size_range"] == [40, 48]
    assert selection["basis"].startswith("rests on node node-whole alone: the more conservative")
    assert selection["rests_on"] == "node-whole"


def test_a_mig_slice_in_any_form(store_client: TestClient) -> None:
    mig = make_profile(
        device_name=f"{H100} MIG 1g.10gb",
        node_name="node-mig",
        max_micro_batch_size=8,
        recommended_micro_batch_size=4,
        trials=trials(8, 12),
        total_memory_bytes=10 * GiB,
        capacity_bytes=10 * GiB,
    )
    mig_id, _ = publish(store_client, mig, WHOLE)

    for body in (
        {"card": f"{LABEL}-MIG-1g.10gb"},
        {
            "card": LABEL,
            "device": {
                "node_labels": {
                    "nvidia.com/gpu.product": LABEL,
                    "nvidia.com/gpu.memory": "81559",
                    "nvidia.com/mig-1g.10gb.memory": "9984",
                },
                "mig_profile": "1g.10gb",
            },
        },
    ):
        answer = plan(store_client, **body)
        assert answer["selection"]["profile_id"] == mig_id, body
        assert answer["selection"]["match"] == "measured"
