"""POST /v1/plan for a job on mixed cards (``job``: cards and counts) over real stored profiles on
SQLite: a micro-batch per rank from each card's profile (measured there or predicted for it),
one accumulation count, the effective batch exactly, and each card's plan in ``ranks``."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from autobatch.profile import MemoryModel, Trial
from service.plans.schemas import PlanPublic
from tests.helpers.fake_pynvml import GiB
from tests.planning.test_mixed import mixed
from tests.service.test_plan_card import publish
from tests.service.test_service_api import fields, make_profile, problem

H100, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L40S"
LINE = MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=GiB // 2)


def card_profile(card: str, total_gib: int, sizes: tuple[int, int], recommended: int) -> Any:
    """A profile of the model measured on ``card``: 4 GiB + 0.5 GiB per sample."""
    return make_profile(
        device_name=card,
        total_memory_bytes=total_gib * GiB,
        capacity_bytes=total_gib * GiB,
        max_micro_batch_size=recommended + 4,
        recommended_micro_batch_size=recommended,
        trials=tuple(
            Trial(micro_batch_size=n, fits=True, peak_reserved_bytes=LINE.peak_bytes(n))
            for n in sizes
        ),
        memory_model=LINE,
    )


JOB = [{"card": H100, "count": 4}, {"card": L40S, "count": 4}]


def plan_job(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 1024, "job": JOB, **body},
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    # Exactly a PlanPublic, field for field (the route writes plain dicts and Plans).
    assert PlanPublic.model_validate(answer, strict=True).model_dump(mode="json") == answer
    return answer


def test_a_job_of_two_cards_gets_a_micro_batch_per_rank(client: TestClient) -> None:
    on_h100 = publish(client, card_profile(H100, 80, (32, 128), 144))
    on_l40s = publish(client, card_profile(L40S, 48, (32, 64), 80))

    answer = plan_job(client)

    expected = mixed([144] * 4 + [80] * 4, effective_batch_size=1024)
    sizes = list(expected[0].rank_micro_batch_sizes or ())
    h100, l40s = answer["ranks"]
    assert (h100["card"], h100["count"], h100["first_rank"]) == (H100, 4, 0)
    assert (l40s["card"], l40s["count"], l40s["first_rank"]) == (L40S, 4, 4)
    for group, profile_id, first in ((h100, on_h100, 0), (l40s, on_l40s, 4)):
        plan = group["plan"]
        assert plan["rank_micro_batch_sizes"] == sizes
        assert plan["micro_batch_size"] == sizes[first]
        assert plan["gradient_accumulation_steps"] == expected[0].gradient_accumulation_steps
        assert sum(sizes) * plan["gradient_accumulation_steps"] == 1024
        assert plan["world_size"] == 8 and plan["exact"]
        assert plan["source"] == "cached"
        assert plan["predicted_peak_memory_bytes"] == LINE.peak_bytes(sizes[first])
        assert group["profile_id"] == profile_id
        assert group["selection"]["match"] == "measured"
    assert h100["plan"]["micro_batch_size"] > l40s["plan"]["micro_batch_size"]
    assert h100["plan"]["capacity_bytes"] == 80 * GiB
    assert l40s["plan"]["capacity_bytes"] == 48 * GiB
    assert answer["plan"] == h100["plan"] and answer["profile_id"] == on_h100
    assert answer["configs"]["deepspeed"] is None
    assert "this is a mixed plan" in answer["configs"]["reason"]


def test_a_card_without_the_models_profile_is_predicted_for_its_memory(
    client: TestClient,
) -> None:
    on_h100 = publish(client, card_profile(H100, 80, (32, 128), 144))
    publish(  # another model measured on an L40S: the card's memory is known
        client,
        make_profile(
            device_name=L40S,
            model_fingerprint="fp-other",
            total_memory_bytes=48 * GiB,
            capacity_bytes=48 * GiB,
        ),
    )

    answer = plan_job(client)

    h100, l40s = answer["ranks"]
    assert l40s["selection"]["match"] == "predicted"
    assert l40s["profile_id"] == on_h100
    # Read off the H100's measured peaks (up to 128) for 48 GiB x 0.95: 4 + 0.5 x 83 GiB fits.
    assert l40s["plan"]["max_micro_batch_size"] == 83
    assert l40s["plan"]["source"] == "cached"
    assert l40s["plan"]["capacity_bytes"] == 48 * GiB
    assert any(note.startswith(f"predicted for {L40S}") for note in l40s["plan"]["notes"])
    assert h100["plan"]["source"] == "cached"
    assert h100["plan"]["micro_batch_size"] > l40s["plan"]["micro_batch_size"]
    sizes = h100["plan"]["rank_micro_batch_sizes"]
    assert sum(sizes) * h100["plan"]["gradient_accumulation_steps"] == 1024


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"model_fingerprint": None}, "body", "give exactly one of"),
        ({"card": H100}, "body.card", "card do(es) not go with job"),
        ({"allow_inexact": True}, "body.allow_inexact", "allow_inexact do(es) not go with job"),
        ({"world_size": 4}, "body.world_size", "world_size 4 is not the job's 8 ranks"),
        ({"job": [{"card": H100, "count": 1}] * 2}, "body.job", "names a card more than once"),
        ({"job": [{"card": H100, "count": 0}]}, "body.job.0.count", ""),
    ],
)
def test_a_job_request_is_checked(
    client: TestClient, body: dict[str, Any], field: str, message: str
) -> None:
    response = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 1024, "job": JOB, **body},
    )
    answer = problem(response, 422, "validation")
    assert field in fields(answer), answer
    assert message in str(answer)


def test_a_card_of_unknown_memory_and_an_unreachable_batch_are_refused(
    client: TestClient,
) -> None:
    publish(client, card_profile(H100, 80, (32, 128), 144))
    # Not in autobatch's catalogue, and no profile measured on it: its memory is unknown.
    job = [JOB[0], {"card": "NVIDIA B999", "count": 4}]
    response = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 1024, "job": job},
    )
    assert problem(response, 422, "unknown-card")["errors"][0]["field"] == "body.job.1.card"
    response = client.post(
        "/v1/plan",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 1031,  # prime, above one step of every rank's max
            "job": [{"card": H100, "count": 2}],
        },
    )
    detail = problem(response, 422, "no-feasible-plan")["detail"]
    assert "no mixed plan reaches effective_batch_size 1031 on 2 ranks" in detail


def test_a_card_of_unknown_memory_is_planned_for_the_capacity_its_entry_gives(
    client: TestClient,
) -> None:
    on_h100 = publish(client, card_profile(H100, 80, (32, 128), 144))
    # A card neither the catalogue nor any stored profile knows (the L40S is catalogued).
    job = [JOB[0], {"card": "NVIDIA B999", "count": 4}]
    refused = client.post(
        "/v1/plan",
        json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 1024, "job": job},
    )
    assert "give job[1].capacity_bytes" in problem(refused, 422, "unknown-card")["detail"]

    sized = [job[0], {**job[1], "capacity_bytes": 48 * GiB}]
    answer = plan_job(client, job=sized)

    h100, b999 = answer["ranks"]
    assert (b999["selection"]["match"], b999["profile_id"]) == ("predicted", on_h100)
    # As for a card whose memory a stored profile gave: 48 GiB x 0.95 holds 4 + 0.5 x 83 GiB.
    assert b999["plan"]["max_micro_batch_size"] == 83
    assert b999["plan"]["capacity_bytes"] == 48 * GiB
    assert h100["plan"]["capacity_bytes"] == 80 * GiB  # the H100's own profile, as measured
    sizes = h100["plan"]["rank_micro_batch_sizes"]
    assert sum(sizes) * h100["plan"]["gradient_accumulation_steps"] == 1024


def test_a_job_entrys_capacity_without_a_unit_is_refused_with_the_size_it_meant(
    client: TestClient,
) -> None:
    response = client.post(
        "/v1/plan",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 1024,
            "job": [JOB[0], {**JOB[1], "capacity_bytes": 48}],
        },
    )
    answer = problem(response, 422, "validation")
    assert "body.job.1.capacity_bytes" in fields(answer)
    assert '"capacity_bytes": 51539607552' in str(answer)
