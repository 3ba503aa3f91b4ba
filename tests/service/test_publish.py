"""Publishing a profile with retries (autobatch.client._publish) against a real local HTTP server
that fails its first requests."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from typing import Any

import pytest

from autobatch.client import RetryPolicy, ServiceError, publish_profile
from autobatch.errors import ConfigError
from autobatch.profile import Profile
from tests.service.test_service_api import make_profile


class FlakyHandler(http.server.BaseHTTPRequestHandler):
    """Fails the first ``script`` answers ("503", "503-retry-after", "reset", "401", "409",
    "422"), and every answer while ``down_until``; then answers 201 with the body's hash as
    the id (an idempotent store)."""

    server: FlakyServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.bodies.append(body)
            step = self.server.script.pop(0) if self.server.script else "ok"
            if time.monotonic() < self.server.down_until:
                step = "503"
        if step == "reset":
            self.close_connection = True
            self.connection.close()
            return
        if step == "ok":
            status, payload = 201, {"id": hashlib.sha256(body).hexdigest()[:16]}
        elif step in ("401", "409", "422"):
            status = int(step)
            payload = {"type": "urn:autobatch:problem:validation", "detail": "bad"}
        else:
            status, payload = 503, {"type": "urn:autobatch:problem:store-unavailable"}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if step == "503-retry-after":
            self.send_header("Retry-After", self.server.retry_after)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        """``GET /v1/profiles``: none (``autotune(report_to=...)`` asks before it probes)."""
        data = json.dumps({"profiles": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class FlakyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), FlakyHandler)
        self.lock = threading.Lock()
        self.bodies: list[bytes] = []
        self.script: list[str] = []
        self.retry_after = "0.05"
        """The ``Retry-After`` of a "503-retry-after" answer, seconds."""
        self.down_until = 0.0
        """Every POST answers 503 until this ``time.monotonic()``."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


FAST = RetryPolicy(max_attempts=5, max_seconds=10, base_delay_seconds=0.01, max_delay_seconds=0.1)


def test_a_publish_retries_failures_and_sends_the_same_body(flaky: FlakyServer) -> None:
    flaky.script = ["503", "reset", "503-retry-after"]
    waits: list[float] = []
    profile = make_profile(node_name="node-a")

    profile_id = publish_profile(
        flaky.url, profile, policy=FAST, sleep=lambda s: waits.append(s), draw=lambda: 0.5
    )

    assert len(flaky.bodies) == 4
    assert len(set(flaky.bodies)) == 1
    assert Profile.from_dict(json.loads(flaky.bodies[0])) == profile
    assert profile_id == hashlib.sha256(flaky.bodies[0]).hexdigest()[:16]
    # Full jitter at draw 0.5: 0.5 x 0.01, 0.5 x 0.02; then the server's Retry-After (0.05 s).
    assert waits == [0.005, 0.01, 0.05]
    # Published again (a retry whose answer was lost, say): the same id.
    assert publish_profile(flaky.url, profile, policy=FAST) == profile_id


def test_a_refused_profile_is_not_retried(flaky: FlakyServer) -> None:
    flaky.script = ["422"]

    with pytest.raises(ConfigError, match="POST /v1/profiles: bad"):
        publish_profile(flaky.url, make_profile(), policy=FAST, sleep=lambda s: None)
    assert len(flaky.bodies) == 1


def test_a_publish_gives_up_after_its_attempts(flaky: FlakyServer) -> None:
    flaky.script = ["503"] * 10
    waits: list[float] = []

    with pytest.raises(ServiceError, match=r"gave up after 5 tries .* last: answered 503"):
        publish_profile(flaky.url, make_profile(), policy=FAST, sleep=waits.append)
    assert len(flaky.bodies) == 5
    assert len(waits) == 4
    assert all(0 <= wait <= 0.1 for wait in waits)


def test_a_publish_gives_up_at_its_time_bound_before_sleeping_past_it(flaky: FlakyServer) -> None:
    flaky.script = ["503"] * 10
    policy = RetryPolicy(max_attempts=10, max_seconds=0.5, base_delay_seconds=0.4)
    waits: list[float] = []

    with pytest.raises(ServiceError, match="gave up after 2 tries"):
        publish_profile(
            flaky.url, make_profile(), policy=policy, sleep=waits.append, draw=lambda: 1.0
        )
    assert waits == [0.4]  # the next wait (0.8 s) would end past 0.5 s: no third try


@pytest.mark.parametrize(
    ("attempt", "draw", "expected"), [(0, 1.0, 2.0), (3, 1.0, 16.0), (10, 1.0, 30.0), (4, 0.0, 0)]
)
def test_delay_is_exponential_capped_and_jittered(
    attempt: int, draw: float, expected: float
) -> None:
    assert RetryPolicy().delay_seconds(attempt, draw) == expected


def test_the_default_policy_spreads_its_tries_over_its_window() -> None:
    """6 tries in 60 s: the longest waits between them add up to the window, not a tenth of it."""
    policy = RetryPolicy()
    longest = [policy.delay_seconds(attempt, 1.0) for attempt in range(policy.max_attempts - 1)]
    assert longest == [2.0, 4.0, 8.0, 16.0, 30.0]
    assert sum(longest) == policy.max_seconds == 60.0


def test_retry_policy_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="max_attempts 0 must be an int >= 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ConfigError, match="max_seconds -1 must be a number of seconds > 0"):
        RetryPolicy(max_seconds=-1)
