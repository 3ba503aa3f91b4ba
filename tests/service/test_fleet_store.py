"""Two service replicas on one PostgreSQL database: what one stores the other answers, concurrent
publishers lose nothing, and a replica killed mid-write leaves the store whole."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from autobatch.store import ProfileStore, profile_id_of
from tests.service.serving import Server, serving
from tests.store.test_store import make_profile

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def replicas(tmp_path: Path, url: str, count: int = 2) -> Iterator[list[Server]]:
    with contextlib.ExitStack() as stack:
        servers = []
        for index in range(count):
            folder = tmp_path / f"replica{index}"
            folder.mkdir()
            servers.append(stack.enter_context(serving(folder, "--store-path", url)))
        yield servers


def body(**overrides: Any) -> dict[str, Any]:
    return make_profile(**overrides).to_dict()


def listed_ids(server: Server, **params: Any) -> list[str]:
    """Every profile id the replica lists, page by page."""
    ids: list[str] = []
    before = None
    while True:
        query = {**params, "limit": 1000, **({"before": before} if before else {})}
        page = server.client.get("/v1/profiles", params=query)
        assert page.status_code == 200, page.text
        data = page.json()
        ids += [entry["id"] for entry in data["profiles"]]
        before = data["next_before"]
        if before is None:
            return ids


def test_a_profile_posted_to_one_replica_is_read_from_the_other(
    tmp_path: Path, postgres_url: str
) -> None:
    with replicas(tmp_path, postgres_url) as (a, b):
        posted = a.client.post("/v1/profiles", json=body(node_name="node-a"))
        assert posted.status_code == 201, posted.text
        profile_id = posted.json()["id"]
        assert profile_id == profile_id_of(make_profile(node_name="node-a"))
        read = b.client.get(f"/v1/profiles/{profile_id}")
        assert read.status_code == 200
        assert read.json()["profile"]["node_name"] == "node-a"
        assert listed_ids(b, node_name="node-a") == [profile_id]
        assert b.client.get("/readyz").json()["store_writable"] is True


@dataclasses.dataclass
class Published:
    ids: list[str] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)


def publish(servers: list[Server], publisher: int, count: int) -> Published:
    """One node's publisher: ``count`` profiles, each to the replicas in turn, retried once on
    the other replica (an idempotent re-put)."""
    done = Published()
    with contextlib.ExitStack() as stack:
        clients = [
            stack.enter_context(httpx.Client(base_url=str(s.client.base_url), timeout=60))
            for s in servers
        ]
        for n in range(count):
            data = body(node_name=f"node-{publisher}", num_steps=n + 1)
            started = time.perf_counter()
            answer = clients[n % len(clients)].post("/v1/profiles", json=data)
            done.seconds.append(time.perf_counter() - started)
            assert answer.status_code == 201, answer.text
            done.ids.append(answer.json()["id"])
            if n % 50 == 0:  # a retry, as after a lost answer: the same id, no new row
                again = clients[(n + 1) % len(clients)].post("/v1/profiles", json=data)
                assert again.json()["id"] == done.ids[-1]
    return done


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def test_eight_publishers_lose_nothing_and_replicas_agree(
    tmp_path: Path, postgres_url: str
) -> None:
    num_publishers, num_each = 8, 200
    with replicas(tmp_path, postgres_url) as servers:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(num_publishers) as pool:
            results = list(pool.map(lambda p: publish(servers, p, num_each), range(num_publishers)))
        wall = time.perf_counter() - started
        published = {pid for result in results for pid in result.ids}
        seconds = [s for result in results for s in result.seconds]
        print(
            f"\n8x200 publish to 2 replicas on PostgreSQL: {len(published)} published, wall "
            f"{wall:.1f} s, per publish p50 {statistics.median(seconds) * 1000:.1f} ms, "
            f"p99 {_percentile(seconds, 0.99) * 1000:.1f} ms"
        )
        assert len(published) == num_publishers * num_each
        first, second = (listed_ids(server) for server in servers)
        assert first == second  # the same answers, in the same order
        assert set(first) == published and len(first) == len(published)  # none lost, none twice
        for publisher in (0, 7):
            mine = listed_ids(servers[1], node_name=f"node-{publisher}")
            assert mine == results[publisher].ids[::-1]


def test_a_replica_killed_mid_write_leaves_the_store_whole(
    tmp_path: Path, postgres_url: str
) -> None:
    with replicas(tmp_path, postgres_url) as (victim, survivor):
        acknowledged: list[str] = []
        stop = threading.Event()

        def keep_publishing(worker: int) -> None:
            with httpx.Client(base_url=str(victim.client.base_url), timeout=10) as client:
                for n in range(10_000):
                    if stop.is_set():
                        return
                    try:
                        answer = client.post(
                            "/v1/profiles", json=body(node_name=f"w{worker}", num_steps=n + 1)
                        )
                    except httpx.TransportError:
                        return
                    if answer.status_code == 201:
                        acknowledged.append(answer.json()["id"])

        threads = [threading.Thread(target=keep_publishing, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(acknowledged) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        victim.process.kill()  # SIGKILL, writes in flight
        victim.process.wait()
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert len(acknowledged) >= 40
        assert survivor.client.get("/readyz").json()["store_writable"] is True
        stored = listed_ids(survivor)
        assert set(acknowledged) <= set(stored)  # every acknowledged write is there
        assert len(stored) - len(acknowledged) <= len(threads)  # at most the ones in flight
        with ProfileStore(postgres_url) as store:
            for profile_id in stored:
                assert profile_id_of(store.get(profile_id)) == profile_id  # no torn row
        posted = survivor.client.post("/v1/profiles", json=body(node_name="after"))
        assert posted.status_code == 201
