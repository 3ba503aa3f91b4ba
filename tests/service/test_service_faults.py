"""A real ``autobatch serve`` under the faults a platform team meets: its probe child when the
server is SIGKILLed, connections that send part of their headers or body and stall, clients that
leave mid-body, floods of unknown fields. Through each, ``/healthz`` answers; the latency bound
here is generous (shared CI cores), a functional check, not a benchmark."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.serving import ROOT, Server, serving

pytestmark = pytest.mark.slow

HEALTHZ_BOUND_S = 1.0
"""Generous: the goal is 100 ms (docs/deploy.md); this catches a loop held for seconds."""

SLEEPY_REGISTRY = """
[models.sleepy-mlp]
factory = "tests.service.models:sleepy_mlp"
device = "sim:8MiB"
loss = "cross_entropy"
max_micro_batch_size = 4096
[models.sleepy-mlp.inputs.input]
shape = [32]
[models.sleepy-mlp.inputs.target]
shape = []
dtype = "int64"
high = 10
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def stored_profiles(store: Path) -> list[Any]:
    """The store's profiles, as ``autobatch profiles list --json`` reads them."""
    listed = subprocess.run(
        [sys.executable, "-m", "autobatch", "--store", str(store), "profiles", "list", "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found: list[Any] = json.loads(listed.stdout)
    return found


def test_a_sigkilled_server_leaves_no_probe_child_alive(tmp_path: Path) -> None:
    """The issue: SIGKILL of the server left the probe child running, and it wrote a profile 3 s
    later. The child must die with the server, and store nothing."""
    registry = tmp_path / "models.toml"
    registry.write_text(SLEEPY_REGISTRY)
    with serving(tmp_path, "--config-file", str(registry)) as server:
        job = server.client.post("/v1/probes", json={"model": "sleepy-mlp"}).json()
        deadline = time.monotonic() + 60
        while (state := server.client.get(f"/v1/probes/{job['id']}").json())["child_pid"] is None:
            assert state["status"] in ("queued", "running"), state
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        child = state["child_pid"]
        assert alive(child)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(child):
            assert time.monotonic() < deadline, f"probe child {child} outlived its server"
            time.sleep(0.1)
    time.sleep(6)  # longer than the sleepy model takes to build and probe
    assert stored_profiles(tmp_path / "store.sqlite3") == []


def partial_request(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(data)
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bytes:
    """What the server sent before it closed ``sock``; fails if it keeps it open."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server held the connection for over {within_s} s")
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return received


def read_response(sock: socket.socket) -> bytes:
    """One response off a kept-alive connection (headers, then ``content-length`` bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def no_server_errors(server: Server) -> None:
    metrics = server.client.get("/metrics").text
    assert 'status="500"' not in metrics
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_partial_headers_are_cut_off_and_healthz_answers_meanwhile(tmp_path: Path) -> None:
    """The issue: 600 connections sending partial headers were held open indefinitely."""
    with serving(tmp_path, "--header-timeout-seconds", "3") as server:
        held = [
            partial_request(server.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1")
            for _ in range(600)
        ]
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
        latencies = [server.healthz_seconds() for _ in range(5)]
        print(f"/healthz with 620 stalled connections: max {max(latencies) * 1000:.1f} ms")
        assert max(latencies) < HEALTHZ_BOUND_S, latencies
        answers = [closed_by_server(sock, within_s=20) for sock in held]
        assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[0]
        assert all(closed_by_server(sock, within_s=20) == b"" for sock in idle)
        no_server_errors(server)


def test_the_deadlines_are_per_request_not_per_connection(tmp_path: Path) -> None:
    """A keep-alive connection that sends request after request (each whole, at once) outlives
    the header deadline many times over; a slow but steady body within its deadline is read."""
    with serving(
        tmp_path, "--header-timeout-seconds", "1", "--body-timeout-seconds", "2"
    ) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as kept:
            for _ in range(4):  # one connection, 2.4 s in all
                kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert read_response(kept).startswith(b"HTTP/1.1 200 ")
                time.sleep(0.6)
        text = b'{"max_micro_batch_size": 8, "effective_batch_size": 16}'
        sock = partial_request(
            server.port,
            b"POST /v1/plan HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode(),
        )
        for i in range(0, len(text), 20):  # 3 pieces over 1.2 s: within the 2 s body deadline
            time.sleep(0.4)
            sock.sendall(text[i : i + 20])
        assert closed_by_server(sock, within_s=10).startswith(b"HTTP/1.1 200 ")


def test_a_body_that_stalls_is_cut_off(tmp_path: Path) -> None:
    with serving(tmp_path, "--body-timeout-seconds", "2") as server:
        head = (
            b"POST /v1/plan HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        stalled = [partial_request(server.port, head + b'{"effective_') for _ in range(50)]
        chunked = partial_request(
            server.port,
            b"POST /v1/probes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\n',
        )
        assert server.healthz_seconds() < HEALTHZ_BOUND_S
        for sock in [*stalled, chunked]:
            closed_by_server(sock, within_s=20)
        no_server_errors(server)


def test_a_client_that_leaves_mid_body_is_no_500(tmp_path: Path) -> None:
    """The issue: a client that disconnected mid-body counted as a 500 with two tracebacks."""
    with serving(tmp_path) as server:
        for path, framing in [
            ("/v1/plan", b"Content-Length: 100000\r\n"),
            ("/v1/probes", b"Content-Length: 100000\r\n"),
            ("/v1/profiles", b"Content-Length: 100000\r\n"),
            ("/v1/plan", b"Transfer-Encoding: chunked\r\n"),
        ]:
            body = b"400\r\n" + b" " * 1024 + b"\r\n" if b"chunked" in framing else b" " * 1024
            sock = partial_request(
                server.port,
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
                + b"Content-Type: application/json\r\n"
                + framing
                + b"\r\n"
                + body,
            )
            time.sleep(0.2)
            sock.close()
        time.sleep(0.5)
        assert server.healthz_seconds() < HEALTHZ_BOUND_S
        no_server_errors(server)


def unknown_fields_body(num_fields: int) -> bytes:
    body: dict[str, Any] = {"effective_batch_size": 64, "max_micro_batch_size": 8}
    for i in range(num_fields):
        body[f"unknown_field_{i:05d}_" + "x" * 96] = i
    return json.dumps(body).encode()


def test_unknown_field_floods_leave_healthz_answering(tmp_path: Path) -> None:
    """The issue: a 4.6 MB body of 38,000 unknown fields cost 3 to 5 s of loop time, and 4 at
    once held /healthz for 17 s."""
    flood = unknown_fields_body(38_000)
    assert len(flood) > 4_500_000
    with serving(tmp_path, "--max-body-bytes", str(8 << 20)) as server:
        answers: list[httpx.Response] = []

        durations: list[float] = []

        def post(path: str) -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
                started = time.perf_counter()
                answers.append(
                    client.post(path, content=flood, headers={"Content-Type": "application/json"})
                )
                durations.append(time.perf_counter() - started)

        paths = ["/v1/plan", "/v1/plan", "/v1/probes", "/v1/profiles"]
        threads = [threading.Thread(target=post, args=(path,)) for path in paths]
        for thread in threads:
            thread.start()
        latencies = []
        while any(thread.is_alive() for thread in threads):
            latencies.append(server.healthz_seconds())
            time.sleep(0.005)
        for thread in threads:
            thread.join()
        print(
            f"4 floods answered in {max(durations):.2f} s; /healthz meanwhile: "
            f"{len(latencies)} requests, max {max(latencies or [0]) * 1000:.1f} ms"
        )
        assert max(latencies or [0]) < HEALTHZ_BOUND_S, latencies
        for answer in answers:
            assert answer.status_code == 422, answer.text[:500]
            assert len(answer.content) < 10_000
            body = answer.json()
            assert "unknown_field_00000_" in body["detail"]
            assert "37,99" in body["errors"][-1]["reason"], body["errors"][-1]
        no_server_errors(server)
