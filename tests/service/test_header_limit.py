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


def _send_in_writes(port: int, request: bytes, cuts: list[int]) -> bytes:
    """Send ``request`` in writes cut at the offsets ``cuts``; the server's answer, read to its
    close."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = 0
        try:
            for end in [*cuts, len(request)]:
                sock.sendall(request[start:end])
                start = end
        except OSError:
            pass  # closed by the server once the cap was passed
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass  # the server closed with the rest of the request unread: what came is the answer
        return received


def _request_with_header(value_bytes: int) -> bytes:
    return (
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: "
        + b"a" * value_bytes
        + b"\r\n\r\n"
    )


def test_the_cap_holds_however_the_header_bytes_arrive(tmp_path: Path) -> None:
    over = _request_with_header(MAX_HEADER_BYTES + 1024)
    boundary = over.index(b"X-Big: ") + MAX_HEADER_BYTES // 2
    ways = {
        "one write": [],
        "one write of 127 KiB": None,
        "many small writes": list(range(1000, len(over), 1000)),
        "split at the cap": [MAX_HEADER_BYTES],
        "split one byte before the end": [len(over) - 1],
        "split inside the header": [boundary],
    }
    with serving(tmp_path) as server:
        for way, cuts in ways.items():
            request = _request_with_header(127 << 10) if cuts is None else over
            answer = _send_in_writes(server.port, request, cuts or [])
            assert answer.startswith(b"HTTP/1.1 431 "), (way, answer[:200])
            assert b"HTTP/1.1 200" not in answer, way
        # Just under the cap, in one write, the request is served.
        under = _request_with_header(MAX_HEADER_BYTES - 200)
        assert _send_in_writes(server.port, under, []).startswith(b"HTTP/1.1 200 ")
