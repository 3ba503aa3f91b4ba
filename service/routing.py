"""``JsonBodyRoute``: routes that take a JSON body answer 415 to any other ``Content-Type``.

Checked before FastAPI reads the body, so a client that sends a form, text, or no
``Content-Type`` gets that answer instead of a confusing type error. Done in the route class
(FastAPI's documented hook for custom request handling) rather than a per-route dependency:
it applies to exactly the routes with a body, and costs one function call, not a dependency
resolution. Other methods and unknown paths never reach it (they get 405 and 404).

Example::

    router = APIRouter(prefix="/v1/plan", route_class=JsonBodyRoute)
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from service.problems import Problem

__all__ = ["JsonBodyRoute", "is_json_media_type"]


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters ignored."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class JsonBodyRoute(APIRoute):
    """An ``APIRoute`` whose body, if it takes one, must be declared JSON (else 415)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def checked(request: Request) -> Response:
            content_type = request.headers.get("content-type")
            if not is_json_media_type(content_type):
                given = (
                    "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
                )
                raise Problem(
                    415,
                    "unsupported-media-type",
                    f"send the body as JSON with Content-Type: application/json ({given} given)",
                    field="header.content-type",
                )
            return await handler(request)

        return checked
