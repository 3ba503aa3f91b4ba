"""A real ``autobatch serve`` in a subprocess on a free loopback port, for tests that need the
real server: its event loop, its HTTP parser, its child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    client: httpx.Client
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthz_seconds(self) -> float:
        """Wall time of one ``GET /healthz`` on a fresh connection (connect, send, read to the
        close), seconds; over a bare socket, so the client's own work barely counts."""
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            received = b""
            while chunk := sock.recv(4096):
                received += chunk
        elapsed = time.perf_counter() - started
        assert received.startswith(b"HTTP/1.1 200 "), received
        return elapsed


@contextmanager
def serving(tmp_path: Path, *flags: str, token: str | None = None) -> Iterator[Server]:
    """The server with ``flags`` (a store in ``tmp_path`` unless they name one), started from
    the checkout (registry factories such as ``tests.service.models`` import from there);
    SIGTERM at the end, SIGKILL if it does not stop in 30 s."""
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AUTOBATCH_API_TOKEN", None)
    if token is not None:
        env["AUTOBATCH_API_TOKEN"] = token
    if "--store-path" not in flags:
        flags = ("--store-path", str(tmp_path / "store.sqlite3"), *flags)
    script = Path(sys.executable).with_name("autobatch")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "autobatch"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*command, "serve", "--port", str(port), "--log-level", "warning", *flags],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30)
        server = Server(process=process, client=client, port=port, log_path=log_path)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"server did not start (exit {process.poll()}): {server.log()}")
                time.sleep(0.2)
            yield server
        finally:
            client.close()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                finally:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
