"""What central forgets, nodes forget (issue 43): a deleted profile leaves a tombstone on either
backend, ``GET /v1/profile-deletions`` follows them by a cursor, and a node sidecar deletes its
copy within the stated bound, after which the copy answers no plan."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

import service.plans.limits as limits
from autobatch.errors import ProfileDeletedError
from autobatch.planning import select_profile
from autobatch.profile import Profile
from autobatch.store import ProfileStore, profile_id_of
from service.fleet.forgetting import DEFAULT_INTERVAL_SECONDS, Forgetting
from service.fleet.publisher import _send
from service.web.settings import Settings
from tests.service.conftest import no_nvml
from tests.service.serving import free_port
from tests.service.test_fleet_trust import HONEST, publish
from tests.service.test_roles import measured
from tests.service.test_service_api import make_profile, problem

ADMIN = {"Authorization": "Bearer adm-3b9e"}
NODE_A = {"Authorization": "Bearer pub-a-77c1"}
TOKENS = "admin adm-3b9e\npublish:node-a pub-a-77c1\n"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        url: str = request.getfixturevalue("postgres_url")
        return url
    return str(tmp_path / "central.sqlite3")


def test_deletions_leave_tombstones_in_commit_order(store_path: str) -> None:
    with ProfileStore(store_path) as store:
        ids = [store.put(make_profile(max_micro_batch_size=n)) for n in (40, 41, 42)]
        assert store.page_deletions().deletions == ()
        assert store.delete(ids[1]) is True
        assert store.delete(ids[1]) is False  # gone: no second tombstone
        assert store.forget([ids[0], "0000000000000000", ids[0]]) == [ids[0]]
        page = store.page_deletions(after=0, limit=100)
        assert [d.profile_id for d in page.deletions] == [ids[1], ids[0]]
        assert page.next_after == page.deletions[-1].cursor > page.deletions[0].cursor
        assert store.page_deletions(after=page.next_after).deletions == ()
        assert store.page_deletions(after=page.next_after).next_after == page.next_after
        first = store.page_deletions(after=0, limit=1)
        assert [d.profile_id for d in first.deletions] == [ids[1]]
        assert [d.profile_id for d in store.page_deletions(after=first.next_after).deletions] == [
            ids[0]
        ]
        # Stored again (a resend), a deleted profile stays deleted: its tombstone refuses it.
        with pytest.raises(ProfileDeletedError) as refused:
            store.put(make_profile(max_micro_batch_size=41))
        assert refused.value.profile_id == ids[1]
        with pytest.raises(ProfileDeletedError):
            store.publish(make_profile(max_micro_batch_size=41))
        assert store.page_deletions(after=page.next_after).deletions == ()
        assert [pid for pid, _ in store.list_profiles()] == [ids[2]]


def test_the_deletions_route_follows_the_cursor(
    make_app: Callable[..., FastAPI], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    client = TestClient(make_app(api_tokens_file=tokens))
    created = client.post("/v1/profiles", json=measured("node-a", 32).to_dict(), headers=NODE_A)
    profile_id = created.json()["id"]
    empty = client.get("/v1/profile-deletions", headers=NODE_A).json()
    assert empty == {"deletions": [], "next_after": "0"}
    assert client.delete(f"/v1/profiles/{profile_id}", headers=ADMIN).status_code == 204
    page = client.get("/v1/profile-deletions?after=0", headers=NODE_A).json()
    assert [d["profile_id"] for d in page["deletions"]] == [profile_id]
    assert page["deletions"][0]["deleted_at"].startswith("20")
    after = client.get(f"/v1/profile-deletions?after={page['next_after']}", headers=NODE_A)
    assert after.json() == {"deletions": [], "next_after": page["next_after"]}
    bad = problem(client.get("/v1/profile-deletions?after=-1", headers=NODE_A), 422, "validation")
    assert bad["errors"][0]["field"] == "query.after"


@contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the central service did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_profile_deleted_at_central_stops_answering_on_the_node(
    make_app: Callable[..., FastAPI], tmp_path: Path, store_path: str
) -> None:
    """The issue: after an admin deleted a profile at central (204, then 404), a sidecar that
    had copied it kept planning from its copy."""
    assert DEFAULT_INTERVAL_SECONDS + 2 <= 30  # the default bound docs/deploy.md states
    assert Settings().central_deletions_interval_seconds == DEFAULT_INTERVAL_SECONDS
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    central_app = make_app(api_tokens_file=tokens, store_path=store_path)
    plan = {"model_fingerprint": "fp-gpt2", "effective_batch_size": 64}
    with served(central_app) as url:
        central = TestClient(central_app)
        created = central.post(
            "/v1/profiles", json=measured("node-a", 32).to_dict(), headers=NODE_A
        )
        profile_id = created.json()["id"]
        node_app = make_app(
            central_url=url,
            central_api_token="pub-a-77c1",
            central_deletions_interval_seconds=0.2,
        )
        with TestClient(node_app) as node:
            answer = node.post("/v1/plan", json=plan)
            assert answer.status_code == 200 and answer.json()["profile_id"] == profile_id
            node_store: ProfileStore = node_app.state.service.store
            assert node_store.get(profile_id).max_micro_batch_size == 32  # the node's copy
            assert central.delete(f"/v1/profiles/{profile_id}", headers=ADMIN).status_code == 204
            deleted = time.monotonic()
            while [pid for pid, _ in node_store.list_profiles()] == [profile_id]:
                assert time.monotonic() - deleted < 30, "the copy outlived the stated bound"
                time.sleep(0.05)
            assert node_store.list_profiles() == []
            gone = node.post("/v1/plan", json=plan)
            assert gone.status_code == 404, gone.text
            # the node's own profile, deleted at central after it was published, goes too
            own = node_store.put(measured("node-a", 16))
            central.post("/v1/profiles", json=measured("node-a", 16).to_dict(), headers=NODE_A)
            assert central.delete(f"/v1/profiles/{own}", headers=ADMIN).status_code == 204
            deleted = time.monotonic()
            while node_store.list_profiles():
                assert time.monotonic() - deleted < 30, "the node's own copy outlived the bound"
                time.sleep(0.05)


def test_a_deleted_profile_stays_deleted_when_resent(make_app: Callable[..., FastAPI]) -> None:
    # A node outbox's retry racing the admin's DELETE: the tombstone already went to the
    # nodes, so the resend is 410 (the outbox takes it as final) and nothing is stored.
    central = TestClient(make_app(nvml=no_nvml()), raise_server_exceptions=False)
    (profile_id,) = publish(central, HONEST[0])
    assert central.delete(f"/v1/profiles/{profile_id}").status_code == 204
    resent = central.post("/v1/profiles", json=HONEST[0].to_dict())
    body = problem(resent, 410, "deleted-profile")
    assert f"profile {profile_id} was deleted" in body["detail"]
    assert "publish a new profile" in body["detail"]
    assert central.get(f"/v1/profiles/{profile_id}").status_code == 404
    deletions = central.get("/v1/profile-deletions").json()
    assert [d["profile_id"] for d in deletions["deletions"]] == [profile_id]  # one tombstone


def test_a_node_outbox_drops_a_profile_central_deleted() -> None:
    answer = httpx.Response(410, json={"detail": "profile 0 was deleted"})
    http = httpx.Client(
        base_url="http://central.invalid", transport=httpx.MockTransport(lambda _: answer)
    )
    with http:
        assert _send(http, b"{}", None).outcome == "refused"  # taken out, never resent


class _Central:
    """A central service that deleted one profile (its tombstone at cursor 1)."""

    url = "http://central.invalid"

    def __init__(self, deleted: str) -> None:
        self.deleted = deleted

    def deletions_after(self, cursor: int, *, limit: int) -> tuple[list[str], int]:
        return ([self.deleted], 1) if cursor < 1 else ([], cursor)


class _FetchedBefore:
    """A central service whose answer was fetched before it deleted that profile."""

    def __init__(self, profile_id: str) -> None:
        self.profile_id = profile_id

    def latest_per_node(self, model_fingerprint: str, *, limit: int) -> list[tuple[str, Profile]]:
        return [(self.profile_id, HONEST[0])]


def test_a_copy_stored_just_after_its_tombstone_is_forgotten_too(tmp_path: Path) -> None:
    # A node copies a central profile (GET, then store.put) while its deletion travels: the
    # tombstone pass runs between the GET and the put, the node never having held the copy.
    store = ProfileStore(tmp_path / "node.sqlite3")
    try:
        profile = HONEST[0]
        fetched_id = profile_id_of(profile)  # the id central has: ids are content hashes
        forgetting = Forgetting(_Central(fetched_id), store)  # type: ignore[arg-type]
        assert forgetting.follow_once() == []  # nothing held here: only the tombstone kept
        with pytest.raises(ProfileDeletedError):
            store.put(profile)  # _from_central's copy, fetched before the deletion
        forgetting.follow_once()  # later passes: nothing new after the cursor
        assert all(pid != fetched_id for pid, _ in store.list_profiles())
        # A plan on the node asking central for the model does not answer from that copy.
        fetched = _FetchedBefore(fetched_id)
        choose = functools.partial(select_profile, card=None, node=None, conditions={})
        found, chosen = limits._from_central(store, fetched, "fp-gpt2", choose, "none")  # type: ignore[arg-type]
        assert (found, chosen) == ([(fetched_id, profile)], None)
        other = store.put(HONEST[1])  # the node's other profiles are stored as ever
        assert [pid for pid, _ in store.list_profiles()] == [other]
    finally:
        store.close()
