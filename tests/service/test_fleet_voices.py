"""One voice per node wherever a plan of the fleet is drawn (issue 43), on SQLite and PostgreSQL:
a node sidecar that holds none of a model draws among central's latest profile per node (``GET
/v1/profiles?latest_per_node=true``), so a node flooding central crowds no honest node out of
what the sidecar sees; a plan by ``model_fingerprint`` alone (no card, no node) is drawn among
the nodes like a plan by card, and shows its selection; and a plan predicted from other cards
draws every node on them as one voice (planning._cards), so one extra node on either card
moves it nowhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.device import catalogue_memory_bytes
from autobatch.planning._cards import predicted_max
from autobatch.profile import MemoryModel, Profile, Trial
from tests.helpers.fake_pynvml import GiB, MiB
from tests.planning.test_selection import budget
from tests.service.conftest import no_nvml
from tests.service.test_deletions import served
from tests.service.test_fleet_trust import H100, L40S, flooder, node_profile, plan
from tests.service.test_plan_selection import publish
from tests.service.test_service_api import problem

L4 = "NVIDIA L4"

HONEST = (
    node_profile("node-b", 64, 60),
    node_profile("node-c", 66, 62),
    node_profile("node-d", 65, 61),
)
"""Three honest nodes of one H100: an H100 plan of effective batch 64 is 2 x 32 from them; the
second most conservative of them is node-d's."""


@pytest.fixture(params=["sqlite", "postgres"])
def store_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")
        return url
    return str(tmp_path / "central.sqlite3")


def flood_central(central: TestClient, count: int) -> list[str]:
    """``count`` profiles of node A (max 4096 each), stored newest: straight into central's
    store, as POST /v1/profiles would (each adds up), without a request each."""
    store = central.app.state.service.store  # type: ignore[attr-defined]
    return [store.put(flooder(index)) for index in range(count)]


def test_a_sidecar_draws_among_central_s_nodes_not_its_newest_profiles(
    make_app: Callable[..., FastAPI], store_path: str
) -> None:
    central_app = make_app(nvml=no_nvml(), store_path=store_path)
    central = TestClient(central_app)
    honest_ids = publish(central, *HONEST)
    flood = flood_central(central, 250)  # more than the 200 newest a sidecar once read
    honest = plan(central, card=H100)
    assert honest["plan"]["micro_batch_size"] == 32  # central's own answer: the honest nodes'
    assert honest["selection"]["outliers"] == ["node-a"]

    with served(central_app) as url:
        by_card = plan(TestClient(make_app(nvml=no_nvml(), central_url=url)), card=H100)
        alone = plan(TestClient(make_app(nvml=no_nvml(), central_url=url)))

    assert by_card["plan"] == honest["plan"]
    selection = by_card["selection"]
    assert selection["profile_id"] == honest["selection"]["profile_id"] == honest_ids[2]
    assert sorted(selection["considered"]) == sorted([*honest_ids, flood[-1]])
    assert (selection["outliers"], selection["rests_on"]) == (["node-a"], None)
    # A plan by the model alone on a sidecar is drawn from central's nodes the same way.
    assert (alone["plan"], alone["profile_id"]) == (honest["plan"], honest_ids[2])


def test_central_lists_each_node_s_latest_profile_of_a_model(
    make_app: Callable[..., FastAPI], store_path: str
) -> None:
    central = TestClient(make_app(nvml=no_nvml(), store_path=store_path))
    honest_ids = publish(central, *HONEST)
    flood = flood_central(central, 30)
    publish(central, node_profile("node-e", 64, 60, model_fingerprint="fp-other"))

    listing = central.get("/v1/profiles?model_fingerprint=fp-gpt2&latest_per_node=true")
    on_card = central.get(
        "/v1/profiles",
        params={"model_fingerprint": "fp-gpt2", "latest_per_node": "true", "device_name": L40S},
    )

    assert listing.status_code == 200, listing.text
    body = listing.json()
    assert [row["id"] for row in body["profiles"]] == [flood[-1], *honest_ids[::-1]]
    assert body["next_before"] is None
    assert on_card.json()["profiles"] == []  # no node measured the model on an L40S
    for query, field in (
        ("latest_per_node=true", "query.model_fingerprint"),
        ("latest_per_node=true&model_fingerprint=fp-gpt2&node_name=node-b", "query.node_name"),
        ("latest_per_node=true&model_fingerprint=fp-gpt2&after=0", "query.after"),
    ):
        refused = problem(central.get(f"/v1/profiles?{query}"), 422, "validation")
        assert refused["errors"][0]["field"] == field, query
    schema = central.get("/openapi.json").json()["paths"]["/v1/profiles"]["get"]
    assert "latest_per_node" in [parameter["name"] for parameter in schema["parameters"]]


@pytest.fixture(params=["sqlite", "postgres"])
def central(request: pytest.FixtureRequest, make_app: Callable[..., FastAPI]) -> TestClient:
    settings: dict[str, Any] = {}
    if request.param == "postgres":
        settings["store_path"] = request.getfixturevalue("postgres_url")
    return TestClient(make_app(nvml=no_nvml(), **settings))


def test_a_flood_does_not_move_a_plan_by_the_model_alone(central: TestClient) -> None:
    honest_ids = publish(central, *HONEST[:2])
    flood = flood_central(central, 61)  # the newest profile of the model is node A's

    answer = plan(central)

    assert answer["plan"]["micro_batch_size"] == 32  # 2 x 32, as the honest nodes put it
    selection = answer["selection"]
    assert selection["profile_id"] == honest_ids[1]  # the second most conservative of three
    assert sorted(selection["considered"]) == sorted([*honest_ids, flood[-1]])
    assert (selection["outliers"], selection["rests_on"]) == (["node-a"], None)
    assert selection["match"] == "measured" and selection["card"] == H100


@pytest.mark.parametrize(("maximum", "recommended"), [(1, 1), (4096, 4096)])
def test_a_lone_outlier_does_not_move_a_plan_by_the_model_alone(
    central: TestClient, maximum: int, recommended: int
) -> None:
    publish(central, *HONEST[:2])
    line = MemoryModel(fixed_bytes=4 * 2**30, bytes_per_sample=16 * 2**20)
    publish(central, node_profile("node-z", maximum, recommended, memory_model=line))

    answer = plan(central)

    assert answer["plan"]["micro_batch_size"] == 32
    assert answer["selection"]["node_name"] in ("node-b", "node-c")
    assert answer["selection"]["outliers"] == ["node-z"]


def test_with_one_or_two_nodes_a_plan_by_the_model_names_the_node_it_rests_on(
    central: TestClient,
) -> None:
    (b_id,) = publish(central, HONEST[0])
    one = plan(central)["selection"]
    assert (one["profile_id"], one["rests_on"], one["considered"]) == (b_id, "node-b", [b_id])
    assert "the only node that measured it" in one["basis"]

    publish(central, HONEST[1])
    two = plan(central)["selection"]
    assert (two["profile_id"], two["rests_on"]) == (b_id, "node-b")  # the more conservative
    assert "the more conservative of 2 nodes" in two["basis"]


def test_a_plan_by_the_model_alone_is_drawn_on_the_card_most_nodes_measured(
    central: TestClient,
) -> None:
    l40s = {"device_name": L40S, "total_memory_bytes": 48 * 2**30, "capacity_bytes": 47 * 2**30}
    # Node Z alone measured the model on an L40S, and last: it does not decide.
    h100_ids = publish(central, *HONEST[:2])
    publish(central, node_profile("node-z", 8, 8, **l40s))

    answer = plan(central)

    assert answer["selection"]["card"] == H100
    assert answer["selection"]["considered"] == sorted(h100_ids)
    assert answer["plan"]["micro_batch_size"] == 32


def card_profile(card: str, node: str, *, per_sample: int) -> Profile:
    """fp-gpt2 measured by ``node`` on ``card`` (an H100 or an L4), its peaks on the line
    4 GiB + ``per_sample`` bytes a sample, at half its maximum and at its maximum."""
    capacity = {H100: 80 * GiB, L4: 24 * GiB}[card]
    maximum = (int(capacity * 0.95) - 4 * GiB) // per_sample
    trials = tuple(
        Trial(micro_batch_size=n, fits=True, peak_allocated_bytes=4 * GiB + per_sample * n)
        for n in (maximum // 2, maximum)
    )
    line = MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=per_sample)
    return node_profile(
        node,
        maximum,
        maximum,
        device_name=card,
        total_memory_bytes=capacity,
        capacity_bytes=capacity,
        memory_model=line,
        trials=trials,
    )


@pytest.mark.parametrize("card", [H100, L4])
@pytest.mark.parametrize("per_sample", [16 * MiB, 3 * GiB], ids=["high", "low"])
def test_one_extra_node_on_either_card_leaves_a_predicted_plan_where_the_four_put_it(
    central: TestClient, card: str, per_sample: int
) -> None:
    # Card A (H100: a1, a2) and card B (L4: b1, b2), none on the L40S asked about.
    honest = [
        card_profile(H100, "a1", per_sample=512 * MiB),
        card_profile(H100, "a2", per_sample=530 * MiB),
        card_profile(L4, "b1", per_sample=560 * MiB),
        card_profile(L4, "b2", per_sample=600 * MiB),
    ]
    publish(central, *honest, card_profile(card, "node-x", per_sample=per_sample))
    l40s_bytes = catalogue_memory_bytes(L40S)
    assert l40s_bytes is not None
    predictions = [predicted_max(profile, l40s_bytes) or 0 for profile in honest]

    answer = plan(central, card=L40S)

    assert answer["selection"]["match"] == "predicted"
    # The second most conservative of the five predictions, whichever card node X joined:
    # above it when X is high (b1), below it when X is low (b2). Before, the card with more
    # nodes spoke, so X's card decided which side answered.
    assert answer["selection"]["node_name"] == ("b1" if per_sample < GiB else "b2")
    assert answer["selection"]["outliers"] == ["node-x"]
    assert answer["plan"]["capacity_bytes"] == l40s_bytes
    assert min(predictions) <= answer["plan"]["max_micro_batch_size"] <= max(predictions)


def test_a_plan_by_the_model_alone_passes_over_a_card_measured_only_under_shares(
    central: TestClient,
) -> None:
    # Three nodes measured the model under a time-sliced 22 GiB share of an H100 80GB PCIe; a
    # share never answers for a whole card, so the two whole-card H100 SXM nodes answer.
    share = {
        "device_name": "NVIDIA H100 PCIe",
        "budget": budget(("time_slicing", 22 * GiB)),
        "capacity_bytes": 22 * GiB,
        "trials": (Trial(micro_batch_size=8, fits=True, peak_reserved_bytes=20 * GiB),),
    }
    for node in ("share-1", "share-2", "share-3"):
        publish(central, node_profile(node, 8, 8, **share))
    h100_ids = publish(central, *HONEST[:2])

    answer = plan(central)

    assert answer["selection"]["card"] == H100
    assert answer["selection"]["considered"] == sorted(h100_ids)
    assert answer["plan"]["micro_batch_size"] == 32
