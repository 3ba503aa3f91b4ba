"""Following the store with ``GET /v1/profiles?after=``: oldest first, paged, and a follower
misses no row while writers' transactions interleave (PostgreSQL)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from autobatch.store import ProfileStore
from tests.service.test_service_api import make_profile


def test_after_lists_oldest_first_and_hands_back_the_next_cursor(
    make_app: Callable[..., Any],
) -> None:
    client = TestClient(make_app())
    ids = [
        client.post("/v1/profiles", json=make_profile(node_name=f"n{i}").to_dict()).json()["id"]
        for i in range(5)
    ]
    first = client.get("/v1/profiles", params={"after": "0", "limit": 3}).json()
    assert [entry["id"] for entry in first["profiles"]] == ids[:3]
    assert first["next_before"] is None
    rest = client.get("/v1/profiles", params={"after": first["next_after"], "limit": 3}).json()
    assert [entry["id"] for entry in rest["profiles"]] == ids[3:]
    idle = client.get("/v1/profiles", params={"after": rest["next_after"]}).json()
    assert idle["profiles"] == [] and idle["next_after"] == rest["next_after"]
    newer = client.post("/v1/profiles", json=make_profile(node_name="n5").to_dict()).json()["id"]
    more = client.get("/v1/profiles", params={"after": idle["next_after"]}).json()
    assert [entry["id"] for entry in more["profiles"]] == [newer]
    assert client.get("/v1/profiles").json()["next_after"] is None  # newest first: no cursor

    both = client.get("/v1/profiles", params={"after": "0", "before": ids[4]})
    assert both.status_code == 422 and "not given with before" in both.json()["detail"]
    assert client.get("/v1/profiles", params={"after": "-1"}).status_code == 422
    assert client.get("/v1/profiles", params={"after": "latest"}).status_code == 422


def test_a_follower_misses_no_row_while_two_writers_interleave_long_transactions(
    postgres_url: str,
) -> None:
    """Two replicas each store 150 profiles; every transaction is held open a few milliseconds
    after its insert (before its commit), so commits land in another order than inserts
    start. A follower polling with the cursor meanwhile sees each row exactly once."""
    num_each = 150
    writers = [ProfileStore(postgres_url) for _ in range(2)]
    follower = ProfileStore(postgres_url)
    rng = random.Random(0)

    def slow_commit(_conn: sa.Connection) -> None:
        time.sleep(rng.uniform(0.0, 0.004))

    written: list[list[str]] = [[], []]
    seen: list[str] = []
    done = threading.Event()

    def write(index: int) -> None:
        for number in range(num_each):
            profile = make_profile(node_name=f"writer{index}-{number}")
            written[index].append(writers[index].put(profile))

    def follow() -> None:
        cursor = 0
        while True:
            finished = done.is_set()
            page = follower.page_profiles(after=cursor, limit=40)
            seen.extend(profile_id for profile_id, _ in page.profiles)
            assert page.next_after is not None
            cursor = page.next_after
            if finished and not page.profiles:
                return

    sa.event.listen(sa.engine.Engine, "commit", slow_commit)
    try:
        threads = [threading.Thread(target=write, args=(index,)) for index in range(2)]
        reader = threading.Thread(target=follow)
        reader.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        done.set()
        reader.join(60)
    finally:
        sa.event.remove(sa.engine.Engine, "commit", slow_commit)
        for store in (*writers, follower):
            store.close()
    assert not reader.is_alive()
    all_written = written[0] + written[1]
    assert len(set(all_written)) == 2 * num_each
    assert sorted(seen) == sorted(all_written)  # none missed, none twice


@pytest.mark.parametrize("backend", ["sqlite"])
def test_the_cursor_never_goes_back_over_a_deleted_newest_row(backend: str, tmp_path: Any) -> None:
    del backend
    with ProfileStore(tmp_path / "s.sqlite3") as store:
        store.put(make_profile(node_name="a"))
        newest = store.put(make_profile(node_name="b"))
        cursor = store.page_profiles(after=0).next_after
        store.delete(newest)
        later = store.put(make_profile(node_name="c"))
        assert [pid for pid, _ in store.page_profiles(after=cursor).profiles] == [later]
