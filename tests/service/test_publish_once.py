"""Publishing is idempotent: the same profile sent again (with or without ``created_at``) is
stored once, on SQLite and PostgreSQL, whether resent by hand, by threads at once, or by a
node's outbox whose first answer was cut."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.store import ProfileStore
from service.fleet.publisher import OutboxPolicy, Publisher
from tests.service.test_service_api import make_profile

FAST = OutboxPolicy(base_delay_seconds=0.05, max_delay_seconds=0.4, timeout_seconds=2.0)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "central.sqlite3")
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.mark.parametrize("created_at", ["", "2026-01-02T03:04:05+00:00"])
def test_the_same_body_posted_three_times_is_stored_once(
    make_app: Callable[..., FastAPI], store_location: str, created_at: str
) -> None:
    app = make_app(store_path=store_location)
    client = TestClient(app)
    body = make_profile(node_name="node-a", created_at=created_at).to_dict()
    answers = [client.post("/v1/profiles", json=body) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [201, 200, 200]
    ids = {answer.json()["id"] for answer in answers}
    assert len(ids) == 1
    assert {answer.headers["Location"] for answer in answers} == {f"/v1/profiles/{ids.pop()}"}
    # The resends answer the profile as first stored, its created_at stamped once.
    stamps = {answer.json()["profile"]["created_at"] for answer in answers}
    assert len(stamps) == 1 and stamps != {""}
    assert len(app.state.service.store.list_profiles(limit=100)) == 1
    # A profile that differs in anything but created_at is another profile.
    other = make_profile(node_name="node-a", num_steps=7, created_at=created_at).to_dict()
    assert client.post("/v1/profiles", json=other).status_code == 201
    assert len(app.state.service.store.list_profiles(limit=100)) == 2


def test_resends_at_once_store_one_row(store_location: str) -> None:
    profile = make_profile(node_name="node-a", created_at="")
    with ProfileStore(store_location) as store:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: store.publish(profile), range(8)))
        assert len({profile_id for profile_id, _, _ in results}) == 1
        assert [new for _, _, new in results].count(True) == 1
        assert len(store.list_profiles(limit=100)) == 1


class _CuttingHandler(http.server.BaseHTTPRequestHandler):
    """Forwards each POST to the central app; the first one's answer is never sent (the
    connection is closed once central stored it), as a cut network would."""

    server: _CuttingProxy

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            answer = self.server.central.post(
                self.path, content=body, headers={"Content-Type": "application/json"}
            )
            self.server.statuses.append(answer.status_code)
            cut = self.server.cut_first and len(self.server.statuses) == 1
        if cut:
            self.close_connection = True
            self.connection.close()
            return
        self.send_response(answer.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _CuttingProxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, central: TestClient, *, cut_first: bool) -> None:
        super().__init__(("127.0.0.1", 0), _CuttingHandler)
        self.central = central
        self.cut_first = cut_first
        self.lock = threading.Lock()
        self.statuses: list[int] = []


@contextmanager
def central_proxy(central: TestClient, *, cut_first: bool = True) -> Iterator[_CuttingProxy]:
    """A loopback HTTP server in front of the central app, cutting the first answer or not."""
    proxy = _CuttingProxy(central, cut_first=cut_first)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()


def test_an_outbox_retry_after_a_lost_answer_stores_one_profile(
    make_app: Callable[..., FastAPI], store_location: str, tmp_path: Path
) -> None:
    central_app = make_app(store_path=store_location)
    with (
        central_proxy(TestClient(central_app)) as proxy,
        ProfileStore(tmp_path / "node.sqlite3") as node_store,
    ):
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        publisher = Publisher(url, token=None, store=node_store, policy=FAST)
        publisher.submit(make_profile(node_name="node-a", created_at=""))
        publisher.open()
        try:
            deadline = time.monotonic() + 60
            while node_store.outbox.count():
                assert time.monotonic() < deadline, "the outbox never emptied"
                time.sleep(0.05)
        finally:
            publisher.close()
    # Stored by the first try (its answer lost), acknowledged by the second: one profile.
    assert proxy.statuses == [201, 200]
    stored = central_app.state.service.store.list_profiles(limit=100)
    assert len(stored) == 1
    assert json.loads(json.dumps(stored[0][1].to_dict()))["node_name"] == "node-a"
