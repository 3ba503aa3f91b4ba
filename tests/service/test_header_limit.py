"""A request's headers are capped (431) by the real server on loopback: a header that never
ends is cut off at ``MAX_HEADER_BYTES`` instead of being kept whole, and ``/healthz`` answers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from service.web.protocol import MAX_HEADER_BYTES
from tests.service.serving import serving

pytestmark = pytest.mark.slow


def _send_endless_header(port: int, num_bytes: int) -> tuple[int, bytes]:
    """Send a request whose one header grows to ``num_bytes``; the bytes sent before the server
    closed the connection, and what it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < num_bytes:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass  # closed by the server, as expected
        return sent, sock.recv(4096)


def test_a_30_mib_header_is_refused_with_431(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        sent, answer = _send_endless_header(server.port, 30 << 20)
        assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer
        assert f"exceed {MAX_HEADER_BYTES} bytes".encode() in answer
        assert sent < 30 << 20  # cut off long before the whole header was sent
        # A request with large but allowed headers, and the server itself, still answer.
        allowed = {"X-Fine": "a" * (MAX_HEADER_BYTES // 2)}
        assert server.client.get("/healthz", headers=allowed).status_code == 200
