"""A node's outbox: every profile reaches the central service, whatever the outages, restarts,
Retry-After and refusals (real HTTP on loopback; short timings through the settings)."""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from autobatch.profile import Profile
from autobatch.store import ProfileStore
from service.fleet.publisher import OutboxPolicy, Publisher
from service.web.metrics import Metrics
from tests.service.serving import free_port, serving
from tests.service.test_publish import FlakyServer
from tests.service.test_service_api import make_profile

FAST = OutboxPolicy(base_delay_seconds=0.05, max_delay_seconds=0.4, timeout_seconds=2.0)


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _metric(metrics: Metrics, name: str) -> float:
    """A sample's value in the exposition, 0 when absent (``name`` with its labels)."""
    text = metrics.render(list).decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@contextmanager
def _central(port: int = 0) -> Iterator[FlakyServer]:
    server = FlakyServer(port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _node_names(server: FlakyServer) -> set[str]:
    return {Profile.from_dict(json.loads(body)).node_name for body in server.bodies}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ProfileStore]:
    with ProfileStore(tmp_path / "node.sqlite3") as opened:
        yield opened


def test_profiles_probed_while_central_is_down_arrive_when_it_is_back(
    store: ProfileStore,
) -> None:
    """Central refuses connections for longer than a bounded retry of 6 tries would last (2.5-3.4
    s): nothing is given up."""
    port, metrics = free_port(), Metrics()
    url = f"http://127.0.0.1:{port}"
    publisher = Publisher(url, token=None, store=store, policy=FAST, metrics=metrics)
    publisher.open()
    started = time.monotonic()
    try:
        for index in range(4):  # probed one after another during the outage
            publisher.submit(make_profile(node_name=f"node-{index}"))
            time.sleep(0.2)
        _wait(
            lambda: (
                sum(entry.attempts for entry in store.outbox.entries()) > 12
                and time.monotonic() - started > 4.0
            ),
            "tries beyond a 6-try retry window",
        )
        assert store.outbox.count() == 4
        with _central(port) as central:
            _wait(lambda: store.outbox.count() == 0, "the outbox to empty")
            assert _node_names(central) == {f"node-{index}" for index in range(4)}
    finally:
        publisher.close()
    assert _metric(metrics, 'autobatch_profiles_published_total{outcome="published"}') == 4
    assert _metric(metrics, 'autobatch_profiles_published_total{outcome="retried"}') > 12
    assert _metric(metrics, "autobatch_outbox_waiting_profiles") == 0


@pytest.mark.slow  # a 20 s outage
def test_ten_queued_through_a_20_s_outage_all_arrive(store: ProfileStore) -> None:
    with _central() as central:
        central.down_until = time.monotonic() + 20.0
        publisher = Publisher(central.url, token=None, store=store, policy=FAST)
        publisher.open()
        try:
            for index in range(10):
                publisher.submit(make_profile(node_name=f"node-{index}"))
            _wait(lambda: store.outbox.count() == 0, "the outbox to empty", timeout=90)
        finally:
            publisher.close()
        assert time.monotonic() >= central.down_until
        assert _node_names(central) == {f"node-{index}" for index in range(10)}


def test_a_full_outbox_drops_its_oldest_and_says_so(
    store: ProfileStore, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    policy = OutboxPolicy(max_rows=3)
    # never opened: nothing is sent
    publisher = Publisher(
        "http://127.0.0.1:9", token=None, store=store, policy=policy, metrics=metrics
    )
    profiles = [make_profile(node_name=f"node-{index}") for index in range(5)]
    ids = [store.put(profile) for profile in profiles]

    with caplog.at_level(logging.WARNING, logger="service.fleet.publisher"):
        for profile in profiles:
            publisher.submit(profile)

    assert [entry.profile_id for entry in store.outbox.entries()] == ids[2:]
    dropped = [r.getMessage() for r in caplog.records if "outbox full" in r.getMessage()]
    assert len(dropped) == 2
    assert f"dropped profile {ids[0]}" in dropped[0] and f"to queue profile {ids[3]}" in dropped[0]
    assert f"dropped profile {ids[1]}" in dropped[1] and f"to queue profile {ids[4]}" in dropped[1]
    assert _metric(metrics, 'autobatch_outbox_dropped_profiles_total{reason="full"}') == 2
    assert _metric(metrics, "autobatch_outbox_waiting_profiles") == 3
    assert len(store.list_profiles()) == 5  # dropped from the outbox, still in the store


def test_retry_after_is_honoured(store: ProfileStore, flaky: FlakyServer) -> None:
    flaky.script = ["503-retry-after"]
    flaky.retry_after = "2.5"
    publisher = Publisher(flaky.url, token=None, store=store, policy=FAST, draw=lambda: 1.0)
    publisher.submit(make_profile())
    publisher.open()
    try:
        first = _wait(
            lambda: next((e for e in store.outbox.entries() if e.attempts == 1), None),
            "the first try",
        )
        # the jittered wait alone would be 0.05 s (draw 1.0 x base): the server asked for 2.5
        assert first.last_attempt_at is not None
        assert first.next_attempt_at - first.last_attempt_at >= 2.5
        assert "503" in first.last_error
        _wait(lambda: store.outbox.count() == 0, "the second try")
    finally:
        publisher.close()
    assert len(flaky.bodies) == 2


def test_refused_for_good_is_taken_out_while_a_bad_token_is_retried(
    store: ProfileStore, flaky: FlakyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """401 (the node's token) is retried; 422 (the profile) is taken out, logged; 409 (already
    there) is an acknowledgement."""
    flaky.script = ["401", "422", "409"]
    metrics = Metrics()
    first, second = make_profile(node_name="first"), make_profile(node_name="second")
    publisher = Publisher(flaky.url, token=None, store=store, policy=FAST, metrics=metrics)
    publisher.submit(first)
    publisher.submit(second)
    with caplog.at_level(logging.WARNING, logger="service.fleet.publisher"):
        publisher.open()
        try:
            _wait(lambda: store.outbox.count() == 0, "the outbox to empty")
        finally:
            publisher.close()
    sent = [Profile.from_dict(json.loads(body)).node_name for body in flaky.bodies]
    assert sent == ["first", "second", "first"]
    refused = [r.getMessage() for r in caplog.records if "refused profile" in r.getMessage()]
    assert len(refused) == 1 and store.put(second) in refused[0] and "422" in refused[0]
    for outcome in ("published", "retried", "refused"):
        sample = f'autobatch_profiles_published_total{{outcome="{outcome}"}}'
        assert _metric(metrics, sample) == 1, outcome


def test_a_profile_deleted_from_the_store_leaves_the_outbox(
    store: ProfileStore, flaky: FlakyServer
) -> None:
    metrics = Metrics()
    publisher = Publisher(flaky.url, token=None, store=store, policy=FAST, metrics=metrics)
    publisher.submit(make_profile(node_name="gone"))
    store.delete(store.outbox.entries()[0].profile_id)
    publisher.open()
    try:
        _wait(lambda: store.outbox.count() == 0, "the outbox to empty")
    finally:
        publisher.close()
    assert flaky.bodies == []
    assert _metric(metrics, 'autobatch_outbox_dropped_profiles_total{reason="missing"}') == 1


@pytest.mark.parametrize(
    ("failures", "draw", "retry_after", "expected"),
    [
        (1, 1.0, None, 1.0),
        (3, 0.5, None, 2.0),
        (7, 1.0, None, 60.0),
        (500, 1.0, None, 60.0),
        (1, 0.0, 5.0, 5.0),
        (7, 1.0, 5.0, 60.0),
        (1, 1.0, 7200.0, 3600.0),
    ],
)
def test_the_wait_is_exponential_jittered_capped_and_honours_retry_after(
    failures: int, draw: float, retry_after: float | None, expected: float
) -> None:
    assert OutboxPolicy().delay_seconds(failures, draw, retry_after) == expected


@pytest.mark.slow  # two server starts
def test_sigterm_keeps_the_backlog_and_a_restart_sends_it(tmp_path: Path) -> None:
    port = free_port()
    node_store = tmp_path / "node.sqlite3"
    with ProfileStore(node_store) as store:
        for index in range(10):
            profile_id = store.put(make_profile(node_name=f"node-{index}"))
            store.outbox.enqueue(profile_id, now=time.time(), max_rows=100)
    flags = (
        "--store-path",
        str(node_store),
        "--central-url",
        f"http://127.0.0.1:{port}",
        "--outbox-base-delay-seconds",
        "0.05",
        "--outbox-max-delay-seconds",
        "0.3",
    )
    with serving(tmp_path, *flags) as node:

        def tried() -> bool:
            with ProfileStore(node_store) as seen:
                return sum(entry.attempts for entry in seen.outbox.entries()) >= 3

        _wait(tried, "the node to try while central is down")
        assert "autobatch_outbox_waiting_profiles 10.0" in node.client.get("/metrics").text
    # uvicorn shuts down (lifespan end: the sender stops) and re-raises the SIGTERM it caught
    assert node.process.returncode == -signal.SIGTERM, node.log()
    assert "Traceback" not in node.log()
    with ProfileStore(node_store) as store:
        assert store.outbox.count() == 10

    with _central(port) as central, serving(tmp_path, *flags):
        _wait(lambda: len(_node_names(central)) == 10, "the backlog at central")
    assert _node_names(central) == {f"node-{index}" for index in range(10)}
    with ProfileStore(node_store) as store:
        assert store.outbox.count() == 0
