"""The ASGI gate in front of every route: bearer token, body size, request metrics.

Pure ASGI (no per-request task or stream wrapping), so it adds no task or copy per request. In
order:

- on ``/v1`` (after any ``root_path``): 401 unless exactly one ``Authorization: Bearer <token>``
  matches a configured token (``service.web.auth``: constant time; the tokens file reloaded
  when it changes, ``service.web.token_files``) or, with a reviewer, is a pod's token the
  Kubernetes API accepts (``service.web.kubernetes_tokens``; 503 while it cannot review),
  403 when its role does not allow the route; health and metrics stay open for kubelet
  probes and scrapers; without tokens, ``/v1`` on a loopback connection answers 403 unless
  ``Host`` names loopback (DNS rebinding);
- 413 for a body over ``max_body_bytes``: by ``Content-Length`` alone when it is the only
  framing, else counted while the body is buffered (chunked, or chunked and a length), before
  it is parsed;
- each request is counted and timed under its route template (``/v1/profiles/{profile_id}``,
  ``/docs``), also when this gate answered it before the route ran (401, 413, 499), or
  ``"unmatched"`` for a path no route has, and its method or ``"other"``, so labels stay few; a
  client that left before its body ended counts as 499 (and reaches no route).

These checks live here rather than in FastAPI dependencies: a dependency is resolved per request
on every route, on the hot path of every scheduler's call, and these need nothing but the
headers. The answers are problem details from ``service.web.problems``, like every other error.
(The JSON ``Content-Type`` check needs the matched route, so it is
``service.web.routing.JsonBodyRoute``.)

Example::

    app.add_middleware(
        ServiceMiddleware, max_body_bytes=1 << 20, metrics=metrics, tokens=tokens, reviewer=None
    )
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.web.auth import (
    GRANT_SCOPE_KEY,
    Grant,
    bearer_value,
    host_allowed,
    is_loopback_server,
    required_role,
)
from service.web.kubernetes_tokens import ReviewUnavailable, TokenReviewer
from service.web.metrics import Metrics
from service.web.problems import CLIENT_CLOSED_REQUEST, problem_response
from service.web.token_files import TokenSource

__all__ = ["ServiceMiddleware", "token_matches"]

_log = logging.getLogger("service.auth")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods counted by name; any other (h11 accepts any token) is "other", so labels stay few."""


async def _gone() -> Message:
    """What :meth:`ServiceMiddleware._gate` returns, never called, when the client left while
    its body was read."""
    raise AssertionError("the client is gone")


def token_matches(authorization: str | None, expected: bytes) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <expected>`` (constant time)."""
    return hmac.compare_digest(bearer_value(authorization), expected)


def _route_path(scope: Scope) -> str:
    """The path the router matches: without ``root_path`` (a mount or a proxy prefix), which
    servers leave at the front of ``scope["path"]``."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _route_template(scope: Scope) -> str:
    """The template of the route the request matched, for its metrics label.

    FastAPI's routes record themselves in ``scope["route"]`` when they run; a request this gate
    answered never reached one, and Starlette's plain routes (``/docs``, ``/openapi.json``,
    ``/redoc``) record nothing, so the app's routes are matched here. A path matched for
    another method (a 405) counts under that route; ``"unmatched"`` is a path no route has.
    """
    path = getattr(scope.get("route"), "path", None)
    if path:
        return str(path)
    routes: Any = getattr(getattr(scope.get("app"), "router", None), "routes", ())
    return _match_template(scope, routes) or "unmatched"


def _match_template(scope: Scope, routes: Any) -> str | None:
    """The template of the first of ``routes`` that matches ``scope`` fully, else of the first
    that matches but for the method; None when none does."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.NONE:
            continue
        included = getattr(route, "original_router", None)  # FastAPI's included router
        # main.py includes each router without a prefix of its own: its routes' paths are whole.
        template = (
            _match_template(scope, included.routes)
            if included is not None
            else getattr(route, "path", None)
        )
        if template and match is Match.FULL:
            return str(template)
        partial = partial or template
    return partial


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class ServiceMiddleware:
    """See the module docstring. No ``tokens`` leaves ``/v1`` open (Host checked on loopback)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        metrics: Metrics,
        tokens: TokenSource,
        reviewer: TokenReviewer | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self._tokens = tokens
        self._reviewer = reviewer

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
            replay = await self._gate(scope, receive, send_counted)
            if replay is _gone:
                status = CLIENT_CLOSED_REQUEST
            elif replay is not None:
                await self.app(scope, replay, send_counted)
        finally:
            template = _route_template(scope)
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.observe_request(method, template, status, time.perf_counter() - started)

    async def _gate(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The receive to hand on (replaying a buffered body), None after a problem, ``_gone``
        when the client left mid-body."""
        headers: dict[str, list[str]] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.decode("latin-1").lower(), []).append(value.decode("latin-1"))
        refusal = await self._refusal(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return None
        declared = headers.get("content-length", [])
        if len(declared) == 1 and declared[0].isascii() and declared[0].isdigit():
            if int(declared[0]) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return None
            if "transfer-encoding" not in headers:
                return receive  # the server delivers exactly Content-Length bytes, no more
        if scope["method"] not in _BODY_METHODS:
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _gone  # a truncated body is no request
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

    async def _refusal(self, scope: Scope, headers: dict[str, list[str]]) -> ASGIApp | None:
        """The 401 or 403 for a request its token (or, tokenless, its Host) does not allow;
        None to go on, with the token's grant in the scope (``service.web.auth``)."""
        path = _route_path(scope)
        if not _is_api(path):
            return None
        if not self._tokens and self._reviewer is None:
            host = headers.get("host", [])
            if not is_loopback_server(scope.get("server")) or (
                len(host) == 1 and host_allowed(host[0])
            ):
                return None
            return problem_response(
                403,
                "host-not-allowed",
                "this server has no API token and answers only requests addressed to "
                "localhost, 127.0.0.1 or [::1] (a guard against DNS rebinding); set "
                "AUTOBATCH_API_TOKEN (docs/service.md) to serve other names",
                instance=scope["path"],
            )
        given = headers.get("authorization", [])
        # Exactly one header: with several, servers and proxies disagree on which one counts.
        try:
            grant = await self._identify(given[0]) if len(given) == 1 else None
        except ReviewUnavailable as exc:
            _log.warning("%s", exc)
            return problem_response(
                503,
                "identity-unavailable",
                "the token could not be checked: the Kubernetes API server did not review it "
                "(see the server's log); retry later",
                instance=scope["path"],
            )
        if grant is None:
            return problem_response(
                401,
                "unauthorized",
                "missing or wrong bearer token: send one Authorization: Bearer <token>",
                instance=scope["path"],
                headers={"WWW-Authenticate": "Bearer"},
            )
        role = required_role(scope["method"], path)
        if not grant.allows(role):
            return problem_response(
                403,
                "forbidden",
                f"{scope['method']} {path} needs a token with the {role} role; this token's "
                f"role is {grant.describe}",
                instance=scope["path"],
            )
        scope[GRANT_SCOPE_KEY] = grant
        return None

    async def _identify(self, authorization: str) -> Grant | None:
        """The grant of a configured token, else of a pod's token the reviewer accepts."""
        grant = self._tokens.current().identify(authorization)
        if grant is None and self._reviewer is not None:
            presented = bearer_value(authorization)
            grant = await self._reviewer.review(presented) if presented else None
        return grant

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await problem_response(
            413,
            "body-too-large",
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            errors=[("body", f"at most {self.max_body_bytes} bytes")],
            instance=scope["path"],
        )(scope, receive, send)
