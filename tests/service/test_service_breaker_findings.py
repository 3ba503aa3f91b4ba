"""Faults found by trying to break the newest service features (admissions, arrival checks,
plans drawn among nodes, token files reloading, deletions as tombstones). Each test states
what should happen; an ``xfail(strict=True)`` one fails today."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import service.web.token_files as token_files
from autobatch.profile import MemoryModel, Trial
from autobatch.store import ProfileStore
from service.fleet.forgetting import Forgetting
from service.web.kubernetes_tokens import NODE_NAME_EXTRA, KubernetesSettings, TokenReviewer
from service.web.token_files import RELOAD_CHECK_SECONDS, TokenSource
from tests.helpers.fake_pynvml import GiB, MiB
from tests.service.conftest import no_nvml
from tests.service.test_fleet_trust import H100, HONEST, L40S, node_profile, publish


@pytest.fixture
def central(make_app: Callable[..., FastAPI]) -> TestClient:
    return TestClient(make_app(nvml=no_nvml()), raise_server_exceptions=False)


def _plan(client: TestClient, **body: Any) -> Any:
    return client.post(
        "/v1/plan", json={"model_fingerprint": "fp-gpt2", "effective_batch_size": 65536, **body}
    )


def test_a_non_cuda_profile_under_a_catalogued_card_name_is_refused(central: TestClient) -> None:
    fake = node_profile(
        "node-a",
        500_000,
        500_000,
        device_type="cpu",
        total_memory_bytes=2**50,
        capacity_bytes=2**50,
        memory_model=MemoryModel(fixed_bytes=0, bytes_per_sample=1),
        trials=(Trial(micro_batch_size=500_000, fits=True, peak_allocated_bytes=2**40),),
    )
    response = central.post("/v1/profiles", json=fake.to_dict())
    stored = response.status_code == 201
    # Either refused on arrival, or never planning a real card from a petabyte.
    for card in (H100, L40S):
        answer = _plan(central, card=card)
        if answer.status_code == 200:
            assert answer.json()["plan"]["capacity_bytes"] <= 100 * GiB, card
    assert not stored, "an H100 with 1 PiB of memory cannot be true (422 implausible-profile)"


@pytest.mark.xfail(
    strict=True,
    reason="POST /v1/admissions with policy.size and a max_world_size below every allowed "
    "world size raises pydantic's ValidationError inside the handler: 500 internal error",
)
def test_sizing_with_no_allowed_count_under_the_ceiling_is_a_422_not_a_500(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    response = central.post(
        "/v1/admissions",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 64,
            "policy": {"size": True, "max_world_size": 3, "allowed_world_sizes": [4, 8]},
        },
    )
    assert response.status_code in (200, 422), response.text


def test_a_lone_low_node_does_not_undercut_two_nodes_that_ran_more(central: TestClient) -> None:
    capped = [
        node_profile(
            node, 64, 64, stop_kind="limit", stop_reason="limit max_micro_batch_size=64 reached"
        )
        for node in ("node-b", "node-c")
    ]
    publish(central, *capped)
    before = _plan(central, card=H100, effective_batch_size=64).json()["plan"]
    assert before["micro_batch_size"] == 64
    liar = node_profile(
        "node-z", 1, 1, trials=(Trial(micro_batch_size=1, fits=True, peak_allocated_bytes=GiB),)
    )
    publish(central, liar)
    after = _plan(central, card=H100, effective_batch_size=64).json()["plan"]
    assert after["micro_batch_size"] == 64  # today: 1 (x 64 accumulation steps)


@pytest.mark.xfail(
    strict=True,
    reason="a deleted profile published again (a node outbox's retry racing the admin's "
    "DELETE) is stored again under the same id (201, GET 200), though its tombstone already "
    "went out: the nodes forgot it, central answers from it again",
)
def test_a_deleted_profile_stays_deleted_when_resent(central: TestClient) -> None:
    (profile_id,) = publish(central, HONEST[0])
    assert central.delete(f"/v1/profiles/{profile_id}").status_code == 204
    resent = central.post("/v1/profiles", json=HONEST[0].to_dict())
    assert resent.status_code != 201
    assert central.get(f"/v1/profiles/{profile_id}").status_code == 404


@pytest.mark.xfail(
    strict=True,
    reason="TokenSource hashes the tokens file, then reads it again to parse: a writer that "
    "truncates and rewrites the same text in between leaves the tokens of the empty file in "
    "force under the full file's hash, so every token is refused until the file next changes",
)
def test_a_token_file_rewritten_during_a_reload_keeps_its_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    path = tmp_path / "tokens"
    text = "admin adm-1\nread rd-1\n"
    path.write_text(text)
    source = TokenSource(api_token=None, tokens_file=path, clock=lambda: now[0])
    path.write_text(text + "read rd-2\n")  # a change, so the next look reloads
    real_load = token_files.load_tokens

    def load_while_rewritten(**kwargs: Any) -> Any:
        path.write_text("")  # the writer's truncate (open(..., "w")) ...
        try:
            return real_load(**kwargs)
        finally:
            path.write_text(text + "read rd-2\n")  # ... and its write of the same text

    now[0] += RELOAD_CHECK_SECONDS
    with monkeypatch.context() as patch:
        patch.setattr(token_files, "load_tokens", load_while_rewritten)
        source.current()
    for _ in range(3):  # later looks, the file unchanged since
        now[0] += RELOAD_CHECK_SECONDS
        assert source.current().identify("Bearer adm-1") is not None


def test_duplicate_cards_are_named_as_cards_not_world_sizes(central: TestClient) -> None:
    response = central.post(
        "/v1/admissions",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 64,
            "world_size": 1,
            "cards": [H100, H100],
        },
    )
    assert response.status_code == 422
    assert "world size" not in response.json()["detail"]


def test_a_lone_node_on_a_bigger_card_does_not_move_a_predicted_plan(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    before = _plan(central, card=L40S, effective_batch_size=4096).json()["plan"]
    liar = node_profile(
        "node-z",
        4096,
        4096,
        device_name="NVIDIA H200",
        total_memory_bytes=140 * GiB,
        capacity_bytes=139 * GiB,
        memory_model=MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=16 * MiB),
        trials=(Trial(micro_batch_size=4096, fits=True, peak_allocated_bytes=68 * GiB),),
    )
    publish(central, liar)
    after = _plan(central, card=L40S, effective_batch_size=4096).json()["plan"]
    assert after["micro_batch_size"] <= 2 * before["micro_batch_size"]


@pytest.mark.xfail(
    strict=True,
    reason="TokenReviewer keeps refused reviews too, up to 10,000 unexpired: after a flood of "
    "made-up JWT-shaped tokens fills the cache, no review is kept, so a real pod's token is "
    "sent to the API server on every request (and meets the 8-in-flight 503 of the flood)",
)
def test_a_flood_of_refused_tokens_does_not_stop_real_tokens_being_kept() -> None:
    settings = KubernetesSettings(
        api_url="https://kubernetes.invalid", service_accounts=frozenset({"default:autobatch"})
    )
    reviewer = TokenReviewer(settings, clock=lambda: 100.0)
    real = b"eyJ.real-pod-token.sig"
    asked: list[bytes] = []

    async def post(token: bytes) -> dict[str, Any]:
        asked.append(token)
        if token != real:
            return {"authenticated": False}
        return {
            "authenticated": True,
            "audiences": ["autobatch"],
            "user": {
                "username": "system:serviceaccount:default:autobatch",
                "extra": {NODE_NAME_EXTRA: ["node-a"]},
            },
        }

    reviewer._post = post  # type: ignore[method-assign]

    async def run() -> None:
        for n in range(10_000):
            assert await reviewer.review(f"eyJ.made-up-{n}.sig".encode()) is None
        for _ in range(3):
            assert await reviewer.review(real) is not None

    asyncio.run(run())
    assert asked.count(real) == 1


class _Central:
    """A central service that deleted one profile (its tombstone at cursor 1)."""

    url = "http://central.invalid"

    def __init__(self, deleted: str) -> None:
        self.deleted = deleted

    def deletions_after(self, cursor: int, *, limit: int) -> tuple[list[str], int]:
        return ([self.deleted], 1) if cursor < 1 else ([], cursor)


@pytest.mark.xfail(
    strict=True,
    reason="a node copies a central profile (GET, then store.put) while its deletion travels: "
    "when the sidecar's tombstone pass runs between the GET and the put, the copy is stored "
    "after it was forgotten and stays on the node for good (the cursor moved past it)",
)
def test_a_copy_stored_just_after_its_tombstone_is_forgotten_too(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "node.sqlite3")
    try:
        profile = HONEST[0]
        fetched_id = store.put(profile)  # the id central has: ids are content hashes
        store.forget([fetched_id])  # (only to learn the id; the node held no copy yet)
        forgetting = Forgetting(_Central(fetched_id), store)  # type: ignore[arg-type]
        forgetting.follow_once()  # the tombstone pass, between the GET and the put
        store.put(profile)  # _from_central keeps the copy it fetched before the deletion
        forgetting.follow_once()  # later passes: nothing new after the cursor
        assert all(pid != fetched_id for pid, _ in store.list_profiles())
    finally:
        store.close()


def test_a_smaller_card_is_never_predicted_past_a_bigger_card_s_measured_maximum(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    answer = _plan(central, card=L40S, effective_batch_size=1024).json()
    assert answer["selection"]["device_name"] == H100
    assert answer["plan"]["max_micro_batch_size"] <= 64


def test_a_mig_slice_claiming_the_whole_card_s_memory_is_refused(central: TestClient) -> None:
    slice_ = node_profile("node-m", 64, 60, device_name="NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    response = central.post("/v1/profiles", json=slice_.to_dict())
    assert response.status_code == 422


@pytest.mark.xfail(
    strict=True,
    reason="a job that asks nothing of activation checkpointing is planned from the newest "
    "profile whatever its mode: with full-checkpointing profiles newer than the plain ones, "
    "POST /v1/admissions (and /v1/plan by card or node) answers micro-batch 190 'full', and its "
    "environment (as plan --env writes it) names no checkpointing: the trainer runs 190 "
    "without it (the plain profiles allow 38) and runs out of memory",
)
def test_an_admission_s_environment_says_the_checkpointing_its_micro_batch_needs(
    central: TestClient,
) -> None:
    publish(central, *HONEST)
    line = MemoryModel(fixed_bytes=4 * GiB, bytes_per_sample=GiB // 4)
    publish(
        central,
        *(
            node_profile(
                node,
                200,
                190,
                activation_checkpointing="full",
                memory_model=line,
                created_at="2026-12-01T00:00:00+00:00",
            )
            for node in ("node-b", "node-c", "node-d")
        ),
    )
    answer = central.post(
        "/v1/admissions",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 190,
            "world_size": 1,
            "cards": [H100],
        },
    ).json()
    mode = answer["plan"]["activation_checkpointing"]
    assert mode == "none" or mode in answer["environment"].values()
