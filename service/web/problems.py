"""RFC 9457 problem details: every error the service answers, mapped in this one module.

Each problem is ``application/problem+json`` with ``type`` (a ``urn:autobatch:problem:<slug>``
URI a client can switch on), ``title``, ``status``, ``detail`` and, for bad input, ``errors``: a
list of ``{"field": "body.device.capacity_bytes", "reason": "..."}``.

Mapping: malformed JSON 400; validation 422 (the field path); :class:`ConfigError` and
:class:`NoFeasiblePlanError` 422; unknown profile, model, probe run or route 404; a full probe queue
409; a missing or wrong bearer token 401 and a body over the limit 413 (``service.web.middleware``);
a missing or wrong ``Content-Type`` 415 (``service.web.routing``); :class:`StoreError` and
:class:`DeviceUnavailableError` 503 (slug ``nvml_timeout`` or ``gpu_lost`` when its ``reason``
is one of those; every 503 with ``Retry-After``, and a store's answer without its location or
the driver's text, which go to the log); anything else 500 (a bug: logged, and a fuzz test checks
no input reaches it). A client that left before its body ended gets nothing (there is no one to
answer) and counts as 499, not as an error of the server's.

Answers stay small whatever the input: at most ``MAX_LISTED_ERRORS`` errors are listed (an
unknown field with the field most like it), the rest counted by kind. And they carry no path of
the server's: a store's message names its file, which is logged, and answered as ``<path>``.

Example::

    raise Problem(404, "unknown-profile", "no profile with id 'ab12'", field="body.profile_id")
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, get_args

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from autobatch.errors import (
    AutobatchError,
    ConfigError,
    DeviceUnavailableError,
    NoFeasiblePlanError,
    ProfileNotFoundError,
    StoreError,
)
from service.web.wording import describe, fault_field

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "MAX_LISTED_ERRORS",
    "PROBLEM_MEDIA_TYPE",
    "RETRY_AFTER_SECONDS",
    "BodyValidationError",
    "FieldReason",
    "Problem",
    "ProblemDetails",
    "install_openapi",
    "install_problem_handlers",
    "listed_errors",
    "problem_response",
    "problem_responses",
    "public_text",
    "store_reason",
    "unknown_profile",
    "validation_reason",
]

PROBLEM_MEDIA_TYPE = "application/problem+json"
MAX_LISTED_ERRORS = 10
"""Errors an answer lists one by one; the rest are counted by kind."""
RETRY_AFTER_SECONDS = 5
"""``Retry-After`` on every 503: the store or the GPUs may answer again in a few seconds."""
CLIENT_CLOSED_REQUEST = 499
"""The status counted for a client that left before its request was read (nginx's code); never
sent, there is no one to send it to."""
_TYPE_PREFIX = "urn:autobatch:problem:"
_log = logging.getLogger("service")

_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    410: "Gone",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class FieldReason(BaseModel):
    """One invalid input: where it is and why it is wrong."""

    field: str = Field(description="Dotted path, e.g. 'body.device.capacity_bytes'.")
    reason: str


class ProblemDetails(BaseModel):
    """An RFC 9457 problem details object."""

    type: str = Field(description="'urn:autobatch:problem:<slug>'; clients switch on it.")
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[FieldReason] = Field(default_factory=list)


class Problem(Exception):
    """Raise in a route to answer with a problem (service-level conditions, with the field)."""

    def __init__(
        self,
        status: int,
        slug: str,
        detail: str,
        *,
        field: str | None = None,
        errors: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.detail = detail
        self.field = field
        self.errors = tuple(errors)
        """``(field, reason)`` of each field at fault, when several are (else ``field``)."""


def unknown_profile(profile_id: str, *, field: str) -> Problem:
    """404 for a profile id the store does not hold (never the store's file path: the
    library's message has it, which a client has no business seeing)."""
    return Problem(404, "unknown-profile", f"no profile with id {profile_id!r}", field=field)


def problem_response(
    status: int,
    slug: str,
    detail: str,
    *,
    errors: Sequence[tuple[str, str]] = (),
    instance: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The ``application/problem+json`` response; a 503 always says when to retry
    (``Retry-After``, :data:`RETRY_AFTER_SECONDS` unless ``headers`` name another)."""
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS), **(headers or {})}
    body = {
        "type": _TYPE_PREFIX + slug,
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "instance": instance,
        "errors": [{"field": field, "reason": reason} for field, reason in errors],
    }
    return JSONResponse(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


ErrorStatuses = Sequence[tuple[type[Exception], int, str]]
"""Exception classes with the status and slug each answers, the first that matches deciding."""

_LIBRARY_STATUSES: ErrorStatuses = (
    (ProfileNotFoundError, 404, "unknown-profile"),
    (StoreError, 503, "store-unavailable"),
    (DeviceUnavailableError, 503, "device-unavailable"),
    (NoFeasiblePlanError, 422, "no-feasible-plan"),
    (ConfigError, 422, "invalid-config"),
    (AutobatchError, 422, "autobatch-error"),
)


def _library_problem(exc: Exception, table: ErrorStatuses) -> tuple[int, str]:
    """Status and slug of a library or feature error; (500, "internal") for anything else."""
    if isinstance(exc, DeviceUnavailableError) and exc.reason in _DEVICE_REASON_SLUGS:
        return 503, exc.reason
    for cls, status, slug in table:
        if isinstance(exc, cls):
            return status, slug
    return 500, "internal"


_DEVICE_REASON_SLUGS = ("nvml_timeout", "gpu_lost")
"""Device failures a client retries or routes around, answered under their own slug."""


def _field(loc: Iterable[Any]) -> str:
    return ".".join(str(part) for part in loc)


def _error_field(error: Any, model: type[BaseModel] | None) -> str:
    """A pydantic error's field; for a check of the whole body (a model validator: ``loc``
    ``("body",)``), the field its message is about (:func:`fault_field`)."""
    if tuple(error["loc"]) == ("body",) and error.get("type") == "value_error":
        return fault_field(validation_reason(error), model, leading_only=True)
    return _field(error["loc"])


def validation_reason(error: Any) -> str:
    """A pydantic error's message, without the "Value error, " its validators' messages carry."""
    return str(error["msg"]).removeprefix("Value error, ")


def _reason(error: Any) -> str:
    """:func:`validation_reason`, with the fix for an empty body (FastAPI and
    ``service.web.routing`` both call it a missing field named ``body``) and for a whole float where
    an int belongs."""
    if error.get("type") == "missing" and tuple(error["loc"]) == ("body",):
        return "the request body is empty; send a JSON object (the schema is in /openapi.json)"
    given = error.get("input")
    if error.get("type") == "model_attributes_type":  # "valid dictionary or object to extract..."
        return f"Input should be a JSON object, not {_json_kind(given)}"
    if error.get("type") == "int_type" and isinstance(given, float) and given.is_integer():
        # Strict fields take JSON integers only; a client's float serialisation writes 64.0.
        return f"{validation_reason(error)}; send {int(given)}, not {given!r}"
    return validation_reason(error)


def _json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words: ``an array``, ``a string``, ``null``."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds = ((str, "a string"), (list, "an array"), (int, "a number"), (float, "a number"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "another value")


class BodyValidationError(RequestValidationError):
    """A body a route read itself (``service.web.routing.read_json_body``) failed validation as
    ``body_model``; the validation handler names an unknown field by that model, as it does by
    a declared body's. ``errors`` are those to list; ``unlisted`` counts the others by pydantic
    error type."""

    def __init__(
        self,
        errors: Sequence[Any],
        *,
        body_model: type[BaseModel],
        unlisted: Counter[str] | None = None,
    ) -> None:
        super().__init__(errors)
        self.body_model = body_model
        self.unlisted = unlisted or Counter()


def listed_errors(errors: Sequence[Any]) -> tuple[list[Any], Counter[str]]:
    """The first :data:`MAX_LISTED_ERRORS` of pydantic ``errors``, and the others counted by
    error type."""
    return list(errors[:MAX_LISTED_ERRORS]), Counter(e["type"] for e in errors[MAX_LISTED_ERRORS:])


_KINDS = {"extra_forbidden": "unknown field", "missing": "missing field"}


def _unlisted_reason(unlisted: Counter[str]) -> str:
    """``"37,990 more errors not listed (37,990 unknown fields); ..."``."""
    nouns: Counter[str] = Counter()
    for kind, count in unlisted.items():
        nouns[_KINDS.get(kind, "invalid value")] += count
    total = sum(nouns.values())
    counted = ", ".join(
        f"{count:,} {noun}{'' if count == 1 else 's'}" for noun, count in nouns.most_common()
    )
    return (
        f"{total:,} more error{'' if total == 1 else 's'} not listed ({counted}); fix those "
        "listed and send again (the schema is in /openapi.json)"
    )


_PATH = re.compile(r"(?<![\w.:/-])/(?:[^\s/:;,'\"()]+/)*[^\s/:;,'\"()]+")
"""An absolute path (``/var/lib/autobatch/profiles.sqlite3``), not a URL's path or a ratio."""


_STORE_URL = re.compile(r"\b(?:postgres(?:ql)?|sqlite)(?:\+\w+)?://\S*?(?=[:;,]?(?:\s|$))")
"""A store's URL (``postgresql://ci:***@db:5432/fleet``): its user, host and database."""


def public_text(text: str) -> str:
    """``text`` with each store URL written ``<store>`` and each absolute path ``<path>``: the
    server's files and database are no business of a client's (the log keeps the whole
    message)."""
    return _PATH.sub("<path>", _STORE_URL.sub("<store>", text))


def _unknown_field_hint(
    error: Any, model: type[BaseModel], named: set[type[BaseModel]] | None = None
) -> str:
    """A pydantic error's message; for an unknown field of ``model`` (``loc`` relative to it),
    with the field most like it, or the fields there (once per answer: models in ``named`` have
    had theirs listed, and the model is added)."""
    message: str = error["msg"]
    if error["type"] != "extra_forbidden":
        return message
    *path, name = error["loc"]
    for part in path:  # down to the model that holds the unknown field
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = None if field is None else field.annotation
        nested = [arg for arg in (annotation, *get_args(annotation)) if _is_model(arg)]
        if not nested:
            return message
        model = nested[0]
    names = list(model.model_fields)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    if close:
        return f'{message}; did you mean "{close[0]}"?'
    if named is not None:
        if model in named:
            return f"{message}; no field there is like it"
        named.add(model)
    return f"{message}; the fields are " + ", ".join(f'"{field}"' for field in names)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _declared_body_model(request: Request) -> type[BaseModel] | None:
    """The model of the body FastAPI read for this route, if it declares one."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    annotation = None if body_field is None else body_field.field_info.annotation
    return annotation if _is_model(annotation) else None


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(error.get("type") == "json_invalid" for error in errors):
        reasons = [
            (
                "body",
                f"malformed JSON at character {e['loc'][-1]}: "
                f"{e.get('ctx', {}).get('error', e['msg'])}",
            )
            for e in errors
        ]
        return problem_response(
            400,
            "malformed-json",
            "the request body is not valid JSON",
            errors=reasons,
            instance=request.url.path,
        )
    # The body's model: the one a route that reads its own body names, or the declared one.
    if isinstance(exc, BodyValidationError):
        model: type[BaseModel] | None = exc.body_model
        unlisted = exc.unlisted  # listed already, off the event loop
    else:
        model = _declared_body_model(request)
        errors, unlisted = listed_errors(errors)
    if model is not None:
        named: set[type[BaseModel]] = set()
        errors = [
            {**e, "msg": _unknown_field_hint({**e, "loc": e["loc"][1:]}, model, named)}
            if e.get("type") == "extra_forbidden" and e["loc"][:1] == ("body",)
            else e
            for e in errors
        ]
    reasons = [(_error_field(e, model), _reason(e)) for e in errors]
    detail = "; ".join(f"{field}: {reason}" for field, reason in reasons[:5])
    if unlisted or len(reasons) > 5:
        more = len(reasons) - 5 + sum(unlisted.values())
        detail += f"; and {more:,} more"
    if unlisted:
        reasons.append(("body", _unlisted_reason(unlisted)))
    return problem_response(
        422, "validation", detail or "invalid request", errors=reasons, instance=request.url.path
    )


def _unreadable_body(exc: StarletteHTTPException) -> str | None:
    """Why a body json.loads could not read was refused, with the fix; None for other errors.

    FastAPI (a declared body) and ``service.web.routing`` (a route reading its own) answer such a
    body with a bare 400 "There was an error parsing the body", its cause chained."""
    cause = exc.__cause__
    if exc.status_code != 400:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"not UTF-8 text (byte 0x{cause.object[cause.start]:02x} at position {cause.start}); "
            "send the JSON encoded as UTF-8"
        )
    if isinstance(cause, RecursionError):
        return "nested too deep for the JSON reader; send a JSON object nested a few levels"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return (
            f"a number of more than {sys.get_int_max_str_digits()} digits, more than Python "
            "reads; send each number within its field's range"
        )
    return None


async def _on_disconnect(_request: Request, _exc: Exception) -> Response:
    """The client left mid-body: nothing to answer (the server drops it), no error logged."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a body it lost
        return await _on_disconnect(request, exc)
    reason = _unreadable_body(exc)
    if reason is not None:
        return problem_response(
            400,
            "malformed-json",
            f"the request body is not valid JSON: {reason}",
            errors=[("body", reason)],
            instance=request.url.path,
        )
    slug = {401: "unauthorized", 404: "not-found", 405: "method-not-allowed"}.get(
        exc.status_code, "http-error"
    )
    headers = dict(exc.headers) if exc.headers else {}
    detail = str(exc.detail)
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
        if detail == "Method Not Allowed":  # the router's, which names no fix
            allowed = headers["Allow"]
            detail = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
    elif exc.status_code == 404 and detail == "Not Found":  # the router's
        detail = (
            f"no route {request.method} {request.url.path}; the routes are listed in /openapi.json"
        )
    return problem_response(
        exc.status_code, slug, detail, instance=request.url.path, headers=headers or None
    )


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's 405 names only one route's).

    Asks each top-level route whether it fully matches the path under each method: the public
    ``BaseRoute.matches``, which also sees into included routers."""
    return [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in request.app.router.routes
        )
    ]


async def _on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)
    errors = list(exc.errors) or ([(exc.field, exc.detail)] if exc.field else [])
    return problem_response(
        exc.status, exc.slug, exc.detail, errors=errors, instance=request.url.path
    )


async def _on_library(request: Request, exc: Exception, table: ErrorStatuses) -> JSONResponse:
    if isinstance(exc, ProfileNotFoundError):
        return await _on_problem(request, unknown_profile(exc.profile_id, field="body"))
    status, slug = _library_problem(exc, table)
    if status == 500:
        _log.exception("unhandled error on %s %s", request.method, request.url.path)
        detail = "internal error; see the server log"
    else:
        # Remedies as the request's JSON fields; the server's paths only in its log.
        detail = public_text(describe(exc))
        if isinstance(exc, StoreError):
            _log.warning("%s %s: %s", request.method, request.url.path, exc)
            detail = store_reason(exc) + "; retry later"
    if status in (400, 422):  # the field at fault, by the body's model
        model = getattr(request.state, "body_model", None) or _declared_body_model(request)
        parameters = [r.parameter for r in getattr(exc, "remedies", ()) if r.parameter]
        errors = [(fault_field(detail, model, parameters=parameters), detail)]
    else:
        errors = []
    return problem_response(status, slug, detail, errors=errors, instance=request.url.path)


def store_reason(exc: StoreError) -> str:
    """Why the store failed, as a client may read it: the error's ``reason``, never its message
    (which names the store's file or database server and quotes the driver)."""
    why = exc.reason or "it cannot be used now"
    return f"the profile store failed: {why} (the server's log has the details)"


def install_problem_handlers(app: FastAPI, *, feature_errors: ErrorStatuses = ()) -> None:
    """Register every exception handler of the service on ``app``.

    Args:
        app: the service.
        feature_errors: the features' own exceptions (a probe run's, say) and what each
            answers, after the library's.
    """
    table = (*_LIBRARY_STATUSES, *feature_errors)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return await _on_library(request, exc, table)

    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(ClientDisconnect, _on_disconnect)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Problem, _on_problem)
    handled: list[type[Exception]] = [AutobatchError, *(cls for cls, _, _ in feature_errors)]
    for cls in (*handled, Exception):
        app.add_exception_handler(cls, on_error)


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these statuses, as problem details."""
    return {
        status: {
            "description": _TITLES.get(status, "Error"),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for status in statuses
    }


def install_openapi(app: FastAPI) -> None:
    """Make ``/openapi.json`` describe errors as problem details (not FastAPI's default 422)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in (
            ProblemDetails.model_json_schema(ref_template="#/components/schemas/{model}")
            .get("$defs", {})
            .items()
        ):
            components[name] = definition
        problem = ProblemDetails.model_json_schema(ref_template="#/components/schemas/{model}")
        problem.pop("$defs", None)
        components["Problem"] = problem
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        schema["components"]["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "Needed on /v1 when the server sets AUTOBATCH_API_TOKEN.",
            }
        }
        validation = problem_responses(422)[422]
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                _reference_request_schema(operation, components)
                if path.startswith("/v1/"):
                    operation["security"] = [{"bearer": []}]
                responses = operation.get("responses", {})
                if "422" in responses:
                    responses["422"] = validation
        app.openapi_schema = jsonable_encoder(json.loads(json.dumps(schema)))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _reference_request_schema(operation: dict[str, Any], components: dict[str, Any]) -> None:
    """A JSON body documented inline (``service.web.routing.json_body_openapi``, for a route that
    reads its own body) goes to ``components`` with its nested models, and the operation refers
    to it by name: where FastAPI puts a declared body parameter's model. Copies, never edits,
    the route's ``openapi_extra``, which every app built from the same router shares."""
    body: dict[str, Any] = operation.get("requestBody", {})
    content: dict[str, Any] = body.get("content", {})
    if "application/json" not in content or "$ref" in content["application/json"]["schema"]:
        return
    schema = dict(content["application/json"]["schema"])
    components.update(schema.pop("$defs", {}))
    components[schema["title"]] = schema
    reference = {"schema": {"$ref": f"#/components/schemas/{schema['title']}"}}
    operation["requestBody"] = {**body, "content": {**content, "application/json": reference}}
