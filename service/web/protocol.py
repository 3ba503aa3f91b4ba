"""The HTTP/1.1 connection: uvicorn's httptools protocol with deadlines for reading a request.

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but sets no deadline
while a request arrives: a client that sends part of its headers, or of its body, and then
nothing, holds its connection (a socket, a buffer, a task waiting on the body) for as long as it
likes, and a few hundred such hold the server. Here each request has two:

- its headers within ``header_timeout_s`` of its first byte (or of the connection, for its first
  request): else the connection is closed, after ``408 Request Timeout`` when part of them came;
- its body within ``body_timeout_s`` of the headers' end: else the connection is closed, and the
  route that waits for the body sees the client gone (``service.web.problems`` answers nothing and
  counts a 499, as for any client that leaves mid-body).

And a request's headers hold at most ``MAX_HEADER_BYTES`` (request line included): past that the
client gets ``431 Request Header Fields Too Large`` and the connection is closed, as the parser
would otherwise keep every byte of a header that never ends. The cap holds however the bytes
arrive: the raw bytes are counted while a read ends mid-headers (a header that never ends), and
the parsed line and fields are counted when the headers end (all of them in one read, or the
last of them in a read that also ends them).

Done in the protocol, where the bytes arrive, because the app never sees a request whose
headers have not all come; a proxy in front (nginx's ``client_header_timeout``) would do the
same at the cost of another container and its configuration in every manifest. Each deadline is
one timer per request (``loop.call_later``), armed and cancelled in the parser's callbacks.

Example::

    uvicorn.run(app, http=timed_protocol(header_timeout_s=10, body_timeout_s=30))
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MAX_HEADER_BYTES", "timed_protocol"]

_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


_HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8"
    b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)

MAX_HEADER_BYTES = 64 << 10
"""The most bytes a request's line and headers may hold (64 KiB: four times what nginx takes by
default, far more than a bearer token and a browser's cookies)."""


class _TimedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with the header and body deadlines and the header cap of the module
    docstring."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_header_bytes = MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_body = False
        self._in_message = False
        self._header_bytes = 0
        self._field_bytes = 0
        self._refused = False

    def _arm(self, seconds: float, *, body: bool) -> None:
        self._disarm()
        self._reading_body = body
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_message and not self._reading_body:  # part of the headers came: say why
            text = f"the request headers did not arrive within {self.header_timeout_s:g} s"
            self.transport.write(_REQUEST_TIMEOUT % (len(text), text.encode()))
        self.transport.close()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, body=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Bytes after a response that begin no message yet still start the header clock (the
        # keep-alive timer, which they cancel, no longer runs).
        if self._deadline is None and self._between_requests():
            self._arm(self.header_timeout_s, body=False)
        reading_headers = not self._reading_body
        if reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Still in the headers after this chunk (a chunk that ended them may carry the body too).
        still_reading = reading_headers and not self._reading_body
        if still_reading and self._header_bytes > self.max_header_bytes:
            self._refuse_headers()

    def _refuse_headers(self) -> None:
        self._disarm()
        self._refused = True
        if self.transport.is_closing():
            return
        text = (
            f"the request's headers exceed {self.max_header_bytes} bytes "
            "(the server's limit); send fewer or shorter headers"
        )
        self.transport.write(_HEADERS_TOO_LARGE % (len(text), text.encode()))
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        self._field_bytes = 0
        if self._deadline is None:  # a pipelined request, behind one still being answered
            self._arm(self.header_timeout_s, body=False)

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # the parser's stop after a 431 is not a second answer
            super().send_400_response(msg)

    def on_url(self, url: bytes) -> None:
        self._field_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_bytes += len(name) + len(value) + len(b": \r\n")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # The request line around the URL: the method, two spaces, the version and its CRLF.
        line_bytes = len(self.parser.get_method()) + len(b"  HTTP/1.1\r\n")
        if self._field_bytes + line_bytes > self.max_header_bytes:
            self._refuse_headers()
            # Stops the parser: no route runs for this request, and the bytes after it are dropped.
            raise httptools.HttpParserError("request headers over the cap")
        self._header_bytes = 0
        self._arm(self.body_timeout_s, body=True)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_message = False
        self._reading_body = False
        super().on_message_complete()


def timed_protocol(*, header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class to pass as ``uvicorn.run(..., http=...)``, with these deadlines in
    seconds (see the module docstring)."""
    return type(
        "TimedHttpToolsProtocol",
        (_TimedHttpToolsProtocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
