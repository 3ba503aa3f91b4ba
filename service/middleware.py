"""The ASGI middleware in front of every route: request metrics and the body size limit.

Pure ASGI (no per-request task or stream wrapping), so it costs microseconds:

- bodies over ``max_body_bytes`` get 413 (by ``Content-Length``, or while reading a chunked body);
- each request is counted and timed under its route template (``/v1/profiles/{profile_id}``), or
  ``"unmatched"`` for unknown paths, so labels stay few.

Example::

    app.add_middleware(ServiceMiddleware, max_body_bytes=1 << 20, metrics=metrics)
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.metrics import Metrics
from service.problems import problem_response

__all__ = ["ServiceMiddleware"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class ServiceMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            replay = await self._check_body(scope, receive, send_counted)
            if replay is not None:
                await self.app(scope, replay, send_counted)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(
                scope["method"], template, status, time.perf_counter() - started
            )

    async def _check_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The receive to hand on (replaying a buffered body), or None after answering 413."""
        headers = {
            key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]
        }
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return None
        if scope["method"] not in _BODY_METHODS:
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await problem_response(
            413,
            "body-too-large",
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            errors=[("body", f"at most {self.max_body_bytes} bytes")],
            instance=scope["path"],
        )(scope, receive, send)
