"""A fleet that trusts measurements, not nodes (issue 43), through POST /v1/profiles and
POST /v1/plan on SQLite and PostgreSQL: a flood, a fictitious card, an impossible profile, a
lone outlier (high and low) and a capped search each leave the fleet's answer where the honest
nodes put it; the answer names the outliers or the node it rests on; a 422 names the fields;
and whatever the library stored, the listing answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device import BudgetReading, combine_budget
from autobatch.profile import MemoryModel, Profile, Trial
from tests.helpers.fake_pynvml import GiB, MiB
from tests.service.conftest import no_nvml
from tests.service.test_plan_selection import publish
from tests.service.test_service_api import make_profile, problem

H100, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L40S"


@pytest.fixture(params=["sqlite", "postgres"])
def central(request: pytest.FixtureRequest, make_app: Callable[..., FastAPI]) -> TestClient:
    """A central service (no NVML) on a fresh SQLite file or PostgreSQL database."""
    settings: dict[str, Any] = {}
    if request.param == "postgres":
        settings["store_path"] = request.getfixturevalue("postgres_url")
    return TestClient(make_app(nvml=no_nvml(), **settings))


def node_profile(node: str, maximum: int, recommended: int, **changes: Any) -> Profile:
    """A profile of fp-gpt2 on an H100 (4 GiB + 0.5 GiB per sample, unless changed)."""
    fields: dict[str, Any] = {
        "device_name": H100,
        "node_name": node,
        "max_micro_batch_size": maximum,
        "recommended_micro_batch_size": recommended,
        "total_memory_bytes": 80 * GiB,
        "capacity_bytes": 79 * GiB,
        "trials": (Trial(micro_batch_size=recommended, fits=True, peak_allocated_bytes=30 * GiB),),
        **changes,
    }
    return make_profile(**fields)


HONEST = (node_profile("node-b", 64, 60), node_profile("node-c", 66, 62))
"""Two honest nodes: an H100 plan of effective batch 64 is 2 x 32 from them."""


def plan(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/plan", json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 64, **body}
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def flooder(index: int) -> Profile:
    """Node A's claim: max 4096 on an H100, with a line that adds up (16 MiB a sample)."""
    return node_profile(
        "node-a",
        4096,
        4096,
        memory_model=MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=16 * MiB),
        created_at=f"2026-12-01T00:{index // 60:02d}:{index % 60:02d}+00:00",
    )


def test_a_flood_of_one_node_counts_once_and_moves_nothing(central: TestClient) -> None:
    b_id, c_id = publish(central, *HONEST)
    flood = publish(central, *(flooder(i) for i in range(61)))

    answer = plan(central, card=H100)

    selection = answer["selection"]
    assert answer["plan"]["micro_batch_size"] == 32  # as before the flood: 2 x 32
    assert selection["profile_id"] == c_id  # the second most conservative of three nodes
    assert sorted(selection["considered"]) == sorted([b_id, c_id, flood[-1]])
    assert (selection["outliers"], selection["rests_on"]) == (["node-a"], None)
    # A plan asked for node B answers from node B's own profile.
    mine = plan(central, node="node-b")
    assert (mine["selection"]["profile_id"], mine["selection"]["rests_on"]) == (b_id, "node-b")


@pytest.mark.parametrize(("maximum", "recommended"), [(1, 1), (4096, 4096)])
def test_a_lone_outlier_high_or_low_leaves_the_answer(
    central: TestClient, maximum: int, recommended: int
) -> None:
    publish(central, *HONEST)
    line = MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=16 * MiB)
    publish(central, node_profile("node-z", maximum, recommended, memory_model=line))

    answer = plan(central, card=H100)

    assert answer["plan"]["micro_batch_size"] == 32
    assert answer["selection"]["node_name"] in ("node-b", "node-c")
    assert answer["selection"]["outliers"] == ["node-z"]


def test_an_impossible_profile_is_refused_naming_its_fields(central: TestClient) -> None:
    # The issue's: max 5000 at 1 GiB a sample on an 80 GB card (a peak of 4.88 TiB).
    impossible = node_profile(
        "node-a", 5000, 2500, memory_model=MemoryModel(fixed_bytes=GiB, bytes_per_sample=GiB)
    )
    response = central.post("/v1/profiles", json=impossible.to_dict())

    body = problem(response, 422, "implausible-profile")
    fields = [error["field"] for error in body["errors"]]
    assert fields == ["body.max_micro_batch_size", "body.memory_model"]
    assert "past capacity_bytes" in body["detail"]
    assert central.get("/v1/profile-summaries").json()["summaries"] == []


def test_a_fictitious_card_is_refused_and_never_speaks_for_a_real_one(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    before = plan(central, card=L40S)
    fictitious = node_profile(
        "node-a",
        500_000,
        500_000,
        device_name="NVIDIA B999",
        total_memory_bytes=2**50,
        capacity_bytes=2**50,
        memory_model=MemoryModel(fixed_bytes=0, bytes_per_sample=1),
    )

    response = central.post("/v1/profiles", json=fictitious.to_dict())

    body = problem(response, 422, "implausible-profile")
    assert [error["field"] for error in body["errors"]] == ["body.device_name"]
    assert "not a card in autobatch's catalogue" in body["detail"]
    after = plan(central, card=L40S)
    assert after["plan"] == before["plan"]
    assert after["selection"]["device_name"] == H100
    assert after["plan"]["capacity_bytes"] == 48 * GiB  # the catalogue's L40S
    # A card the catalogue does not hold, as NVML reported it: stored, and marked as such.
    nvml = BudgetReading(
        source="nvml", total_bytes=96 * GiB, available_bytes=95 * GiB, free_bytes=95 * GiB
    )
    new_card = node_profile(
        "node-d",
        64,
        60,
        device_name="NVIDIA RTX PRO 6000",
        total_memory_bytes=96 * GiB,
        capacity_bytes=95 * GiB,
        budget=combine_budget([nvml]),
    )
    stored = central.post("/v1/profiles", json=new_card.to_dict())
    assert stored.status_code == 201, stored.text
    assert "not in autobatch's catalogue" in stored.json()["profile"]["notes"][-1]
    assert central.post("/v1/profiles", json=new_card.to_dict()).status_code == 200  # a resend
    assert plan(central, card=L40S)["plan"] == before["plan"]  # and it speaks for no other


def test_a_card_only_nvml_vouches_for_answers_for_itself_and_no_other(
    make_app: Callable[..., FastAPI],
) -> None:
    client = TestClient(make_app(nvml=no_nvml()))
    nvml = BudgetReading(
        source="nvml", total_bytes=96 * GiB, available_bytes=95 * GiB, free_bytes=95 * GiB
    )
    (own,) = publish(
        client,
        node_profile(
            "node-d",
            64,
            60,
            device_name="NVIDIA RTX PRO 6000",
            total_memory_bytes=96 * GiB,
            capacity_bytes=95 * GiB,
            budget=combine_budget([nvml]),
        ),
    )

    assert plan(client, card="NVIDIA RTX PRO 6000")["selection"]["profile_id"] == own
    response = client.post(
        "/v1/plan", json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 64, "card": L40S}
    )
    detail = problem(response, 404, "unknown-profile")["detail"]
    # Plainly what to do: probe the card asked about, or ask for the card they were measured on.
    assert detail == (
        "no stored training profile of model_fingerprint 'fp-gpt2' can answer for card "
        "'NVIDIA L40S': they were all measured on 'NVIDIA RTX PRO 6000', a card autobatch's "
        "catalogue does not list, so its memory cannot be checked and they predict for no other "
        "card. To plan for it: probe the model on that card and publish the profile (autobatch "
        'tune --report-to URL there, or POST /v1/profiles); or ask for "card": '
        '"NVIDIA RTX PRO 6000", which they answer as measured'
    )


def test_a_capped_search_never_passes_for_a_maximum(central: TestClient) -> None:
    line = MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=2 * MiB)
    capped = node_profile(
        "node-x",
        4096,
        4096,
        memory_model=line,
        stop_kind="limit",
        stop_reason="limit max_micro_batch_size=4096 reached",
    )
    (measured_id,) = publish(central, node_profile("node-m", 20873, 20000, memory_model=line))
    publish(central, capped)

    answer = plan(central, card=H100, effective_batch_size=20000)

    selection = answer["selection"]
    assert (selection["profile_id"], selection["lower_bounds"]) == (measured_id, ["node-x"])
    assert selection["considered"] == [measured_id]
    assert answer["plan"]["micro_batch_size"] == 20000


def test_each_node_s_latest_per_thing_it_measured_is_read_once(central: TestClient) -> None:
    store = central.app.state.service.store  # type: ignore[attr-defined]
    older = store.put(node_profile("node-b", 60, 60, created_at="2026-12-01T00:00:00+00:00"))
    newer = store.put(node_profile("node-b", 62, 62, created_at="2026-12-02T00:00:00+00:00"))
    other = store.put(
        node_profile(
            "node-c", 60, 60, device_name=L40S, total_memory_bytes=48 * GiB, capacity_bytes=40 * GiB
        )
    )
    evaluation = store.put(node_profile("node-b", 90, 90, mode="eval"))

    found = store.latest_per_node(model_fingerprint="fp-gpt2", limit=10)
    on_h100 = store.latest_per_node(
        model_fingerprint="fp-gpt2", limit=10, card=lambda name: name == H100
    )

    assert [pid for pid, _ in found] == [evaluation, other, newer]
    assert [pid for pid, _ in on_h100] == [evaluation, newer]
    assert older not in [pid for pid, _ in found]
    assert store.latest_per_node(model_fingerprint="fp-gpt2", limit=1)[0][0] == evaluation


def test_whatever_the_library_stored_the_service_lists(central: TestClient) -> None:
    long = "x" * 5000
    stored = make_profile(
        notes=(long,),
        stop_reason=long,
        trials=(Trial(micro_batch_size=48, fits=False, oom=True, error=long),),
        device_name="sim " + "y" * 300,
        device_type="sim",
    )
    store = central.app.state.service.store  # type: ignore[attr-defined]
    profile_id = store.put(stored)

    listing = central.get("/v1/profiles")
    one = central.get(f"/v1/profiles/{profile_id}")

    assert listing.status_code == 200, listing.text
    assert listing.json()["profiles"][0]["profile"]["notes"] == [long]
    assert one.status_code == 200, one.text
    assert Profile.from_dict(one.json()["profile"]) == stored
