"""JSON request bodies: 415 to any other ``Content-Type``, and a cheaper read for hot routes.

``JsonBodyRoute``: routes that declare a JSON body answer 415 to any other ``Content-Type`` (400
to two of them), checked before FastAPI reads the body, so a client that sends a form, text, or
no ``Content-Type`` gets that answer instead of a confusing type error. Done in the route class
(FastAPI's documented hook for custom request handling) rather than a per-route dependency: it
applies to exactly the routes with a body, and costs one function call, not a dependency
resolution. Other methods and unknown paths never reach it (they get 405 and 404).

``read_json_body`` and ``json_body_openapi``: for a route that schedulers call in a loop
(``POST /v1/plan``), the route reads its body itself, as FastAPI documents for custom request
bodies (``openapi_extra``), instead of declaring a body parameter. The answers are the same:
415 as above, 400 ``malformed-json``, 422 with ``body.<field>`` paths; what it saves is FastAPI's
per-request body and dependency handling (a ``Content-Type`` parse with ``email.message``, the
body field's resolution), a fixed cost that is a large share of a route whose own work is a few
dictionary lookups (``bench/service_load.py`` measures it).

Large bodies never hold the event loop (over ``LARGE_BODY_BYTES``): ``read_json_body`` parses
and validates them in a worker thread, and a body with more fields its model does not declare
than an answer lists (``service.web.problems.MAX_LISTED_ERRORS``) is refused from a walk over the
parsed JSON, before pydantic reports each one (a "did you mean" hint per unknown field grows
the work and the answer with the body, so a few megabytes of unknown fields would hold the loop
for seconds). ``JsonBodyRoute`` does the same walk, in a
thread, for a large declared body before FastAPI validates it.

Example::

    router = APIRouter(prefix="/v1/plan", route_class=JsonBodyRoute)

    @router.post("", openapi_extra=json_body_openapi(PlanCreate))
    async def create_plan(request: Request) -> Response:
        body = await read_json_body(request, PlanCreate)
"""

from __future__ import annotations

import asyncio
import functools
import json
import types
import typing
import weakref
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from anyio import CapacityLimiter, to_thread
from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import from_json
from starlette.requests import ClientDisconnect

from service.web.problems import MAX_LISTED_ERRORS, BodyValidationError, Problem, listed_errors

__all__ = [
    "LARGE_BODY_BYTES",
    "JsonBodyRoute",
    "is_json_media_type",
    "json_body_openapi",
    "read_json_body",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

LARGE_BODY_BYTES = 64 << 10
"""Bodies larger than this are parsed and validated off the event loop, after the walk that
refuses a flood of unknown fields (a smaller body holds too few fields to cost much)."""

_LARGE_BODY_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


async def _off_the_loop(function: Callable[..., ModelT | None], *args: Any) -> Any:
    """``function(*args)`` in a worker thread, one large body at a time: the JSON parser and
    pydantic hold the GIL for their whole call (a time that grows with the body's size), so with
    one at a time the event loop waits for one such call at most, not for a queue of them."""
    loop = asyncio.get_running_loop()
    limiter = _LARGE_BODY_LIMITERS.get(loop)
    if limiter is None:
        limiter = _LARGE_BODY_LIMITERS[loop] = CapacityLimiter(1)
    return await to_thread.run_sync(function, *args, limiter=limiter)


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

        annotation = self.body_field.field_info.annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )

        async def checked(request: Request) -> Response:
            _require_json(request)
            if model is not None:
                raw = await request.body()  # kept by the request: FastAPI reads it from there
                if len(raw) > LARGE_BODY_BYTES:
                    await _off_the_loop(_refuse_unknown_field_flood, raw, model)
            return await handler(request)

        return checked


def _require_json(request: Request) -> None:
    """Raises: Problem: 415, the ``Content-Type`` is not JSON."""
    content_type = _content_type(request)
    if not is_json_media_type(content_type):
        given = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
        raise Problem(
            415,
            "unsupported-media-type",
            f"send the body as JSON with Content-Type: application/json ({given} given)",
            field="header.content-type",
        )


def _content_type(request: Request) -> str | None:
    """The ``Content-Type`` header's value, read from the ASGI scope's header list (servers send
    the names in lower case) instead of building the ``Headers`` mapping, which the hot route
    would build only to read this one header.

    Raises:
        Problem: 400, two or more ``Content-Type`` headers (which one a proxy on the way read is
            anyone's guess, so neither is taken).
    """
    found = [value for name, value in request.scope["headers"] if name == b"content-type"]
    if len(found) > 1:
        given = ", ".join(repr(value.decode("latin-1")) for value in found)
        raise Problem(
            400,
            "duplicate-header",
            f"send one Content-Type header ({len(found)} given: {given})",
            field="header.content-type",
        )
    return found[0].decode("latin-1") if found else None


async def read_json_body(request: Request, model: type[ModelT]) -> ModelT:
    """The request's JSON body validated as ``model``, failing as a declared FastAPI body does.

    Parsed to Python objects as ``json.loads`` parses them and validated from those, as FastAPI
    does, so the same input is accepted (models in strict mode accept less from Python than
    from JSON). The validation handler names an unknown field's likely meaning by ``model``, as
    for a declared body.

    Raises:
        Problem: 415, the ``Content-Type`` is not JSON.
        RequestValidationError: malformed JSON (answered 400 ``malformed-json``) or an empty body;
            :class:`service.web.problems.BodyValidationError`, one that ``model`` rejects (422
            ``validation``, fields as ``body.<field>``).
        HTTPException: 400, a body that is not text (invalid UTF-8, say).
    """
    _require_json(request)
    request.state.body_model = model  # the model a library error's field is named by
    raw = await _read_body(request)
    if not raw:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    if len(raw) > LARGE_BODY_BYTES:
        validated: ModelT = await _off_the_loop(_parse_and_validate, raw, model)
        return validated
    return _parse_and_validate(raw, model)


def _parse_and_validate(raw: bytes, model: type[ModelT]) -> ModelT:
    """``raw`` parsed and validated as ``model``; raises as :func:`read_json_body`."""
    try:
        # pydantic-core's parser first (it builds the objects in Rust, where json.loads goes
        # through Python's decoder). It gives
        # the same objects wherever both accept the text; where it refuses (an error, or a text
        # only json takes: a byte-order mark, UTF-16, a lone surrogate escape, nesting past
        # 200), json.loads decides, so what is accepted and every error stay json's.
        data = from_json(raw)
    except ValueError:
        data = _json_loads(raw)
    if len(raw) > LARGE_BODY_BYTES:
        _refuse_unknown_fields(data, model)
    try:
        # from_attributes as FastAPI validates a body (JSON has no attributes; it words the
        # error for a non-object body the same).
        return model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        listed, unlisted = listed_errors(exc.errors(include_url=False))
        raise BodyValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in listed],
            body_model=model,
            unlisted=unlisted,
        ) from None


def _refuse_unknown_field_flood(raw: bytes, model: type[BaseModel]) -> None:
    """For a declared body: :func:`_refuse_unknown_fields` if ``raw`` parses (if it does not,
    FastAPI reports that)."""
    try:
        data = from_json(raw)
    except ValueError:
        return
    _refuse_unknown_fields(data, model)


def _refuse_unknown_fields(data: Any, model: type[BaseModel]) -> None:
    """Raises :class:`BodyValidationError` naming the first unknown fields and counting the
    rest, when ``data`` holds more fields ``model`` does not declare than an answer lists; else
    nothing (pydantic then reports every error, a few)."""
    first: list[tuple[str | int, ...]] = []
    num_unknown = 0
    # Breadth first, so the fields listed come in the body's order, outer before inner.
    queue: deque[tuple[Any, type[BaseModel], tuple[str | int, ...]]] = deque([(data, model, ())])
    while queue:
        value, current, path = queue.popleft()
        if not isinstance(value, dict):
            continue
        fields = _fields_by_key(current)
        forbid = current.model_config.get("extra") == "forbid"
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                if forbid:
                    num_unknown += 1
                    if len(first) < MAX_LISTED_ERRORS:
                        first.append((*path, key))
                continue
            nested, many = _nested_model(field.annotation)
            if nested is None:
                continue
            if not many:
                queue.append((item, nested, (*path, key)))
            elif isinstance(item, list):
                queue.extend((each, nested, (*path, key, i)) for i, each in enumerate(item))
    if num_unknown <= MAX_LISTED_ERRORS:
        return
    errors = [
        {"type": "extra_forbidden", "loc": ("body", *loc), "msg": "Extra inputs are not permitted"}
        for loc in first
    ]
    unlisted = Counter({"extra_forbidden": num_unknown - len(first)})
    raise BodyValidationError(errors, body_model=model, unlisted=unlisted)


@functools.cache
def _fields_by_key(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """The model's fields by every key a body may name them with: name and aliases."""
    found = dict(model.model_fields)
    for field in model.model_fields.values():
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                found[alias] = field
    return found


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (``Model``, ``Model | None``) or a list of (``list[Model]``),
    and whether a list; (None, False) for anything else (scalars, dicts, unions of models)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _nested_model(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _nested_model(options[0]) if len(options) == 1 else (None, False)
    if origin is list:
        (item,) = typing.get_args(annotation) or (None,)
        nested, many = _nested_model(item)
        return (nested, True) if nested is not None and not many else (None, False)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


async def _read_body(request: Request) -> bytes:
    """The request's body bytes, read from its ASGI messages in a plain loop: Starlette's
    ``Request.body()`` reads through an async generator, which adds asyncio's generator hooks and
    ``aclosing`` to every request of the hot route. Nothing reads the body after the route.

    Raises:
        ClientDisconnect: the client left before the body ended (as ``Request.body()`` raises).
    """
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _json_loads(raw: bytes) -> Any:
    """``json.loads(raw)``, its errors raised as a declared FastAPI body's are.

    Raises:
        RequestValidationError: malformed JSON (answered 400 ``malformed-json``).
        HTTPException: 400, a body that is not text (invalid UTF-8, say) or nested too deep.
    """
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from exc
    except (ValueError, RecursionError) as exc:  # not text (invalid UTF-8), or nested too deep
        raise HTTPException(400, "There was an error parsing the body") from exc


def json_body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a required JSON body of ``model`` for a route that reads it
    with :func:`read_json_body`; ``service.web.problems.install_openapi`` moves the schema and its
    nested models to ``components``, as FastAPI places a declared body's."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
