"""How the service words a library error's remedies: as the request's JSON fields.

The library names a remedy by its Python argument (:class:`autobatch.errors.Remedy`); a client of
the service sets a JSON field instead, so ``allow_inexact=True`` reads ``"allow_inexact": true``.
The one place the service words remedies: problem details, probe run errors and plan tables.

Example::

    detail = describe(exc)  # '... not a multiple of world_size 4; use "effective_batch_size": 96
                            #  or 100, or "allow_inexact": true (plan the nearest)'
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import BaseModel

from autobatch.errors import AutobatchError, Remedy

__all__ = ["CALLS", "describe", "fault_field", "field_text", "field_wording"]

_PYTHON_ARGUMENT = re.compile(r"(?<![\w.\-])([a-z]+(?:_[a-z]+)*)=('[^']*'|True|False|\d+)")
"""An argument in Python spelling inside a library text (a plan's note): ``uneven='auto'``."""

_JSON_VALUES = {"True": "true", "False": "false"}

CALLS = {
    "autobatch.autotune": "POST /v1/probes",
    "autobatch.probe": "POST /v1/probes",
}
"""Library calls a library text names (``autobatch.autotune there does``), as the route that
does the same over HTTP (a probe of a registered model); a call written out with its arguments
(``autobatch.autotune(...)``) is code, and left as it is."""

_CALL = re.compile(
    r"(?<![\w.])(" + "|".join(map(re.escape, sorted(CALLS, key=len, reverse=True))) + r")(?![\w.(])"
)

_NO_FIELD = frozenset({"amp_dtype", "eval"})
"""Library arguments no request or registry entry sets: only their purpose is shown."""


_INSIDE = {"capacity_bytes": "device"}
"""Library arguments a request sets inside another field: a plan's ``device.capacity_bytes``."""


def field_wording(remedy: Remedy) -> str:
    """A remedy as the JSON field to set, e.g. ``"allow_inexact": true (plan the nearest)``."""
    if not remedy.parameter or remedy.parameter in _NO_FIELD:
        return remedy.purpose
    values = " or ".join(json.dumps(value) for value in remedy.values)
    phrase = f"{json.dumps(remedy.parameter)}: {values}"
    inside = _INSIDE.get(remedy.parameter)
    if inside is not None:  # {"device": {"capacity_bytes": 85899345920}}
        phrase = f"{json.dumps(inside)}: {{{phrase}}}"
    return f"{phrase} ({remedy.purpose})" if remedy.purpose else phrase


def describe(exc: BaseException) -> str:
    """An exception's message for a service client: remedies and the arguments its text names
    as JSON fields, the library calls it names as routes (:func:`field_text`)."""
    if isinstance(exc, AutobatchError):
        return field_text(exc.describe(field_wording))
    return str(exc)


def field_text(text: str) -> str:
    """A library text (a plan's note) with each Python argument it names as the JSON field to
    set: ``uneven='auto'`` reads ``"uneven": "auto"``, ``allow_inexact=True`` reads
    ``"allow_inexact": true``; a library call it names as the route (:data:`CALLS`:
    ``autobatch.autotune`` reads ``POST /v1/probes``)."""

    def field(match: re.Match[str]) -> str:
        value = match[2]
        if value.startswith("'"):
            value = json.dumps(value.strip("'"))
        return f"{json.dumps(match[1])}: {_JSON_VALUES.get(value, value)}"

    return _CALL.sub(lambda match: CALLS[match[1]], _PYTHON_ARGUMENT.sub(field, text))


_NAME = re.compile(r"(?<![\w.'\"/-])([a-z]+(?:[_.][a-z]+)*)(?![\w'\"(])")
"""A name a library text may give a request field by: ``effective_batch_size``,
``device.capacity_bytes``; a quoted one is a value, not a name."""


def fault_field(
    text: str,
    model: type[BaseModel] | None,
    *,
    parameters: Sequence[str] = (),
    leading_only: bool = False,
) -> str:
    """The request field a library error's ``text`` is about, as ``body.<path>``: its first
    word when that is a field of ``model`` (``uneven 'always' cannot hold ...``:
    ``body.uneven``), else the first field it names in Python spelling (a name with ``_`` or
    ``.``: ``no plan reaches effective_batch_size ...``: ``body.effective_batch_size``), else
    the first of ``parameters`` (the error's remedies) that is one; a name that is no field of
    ``model`` but of a model inside it is that field (``capacity_bytes``:
    ``body.device.capacity_bytes``). ``body`` where it names none (or no model is known).
    ``leading_only``: the first word alone (a check of the whole body, ``give exactly one of
    profile_id, ...``, is about no one field it names).

    Example: ``fault_field("device.capacity_bytes 80 leaves ...", PlanRequestBody)`` is
    ``"body.device.capacity_bytes"``.
    """
    if model is None:
        return "body"
    names = [
        match[1]
        for index, match in enumerate(_NAME.finditer(text))
        if (index == 0 and match.start() == 0)
        or (not leading_only and ("_" in match[1] or "." in match[1]))
    ]
    for name in [*names, *parameters]:
        path = _field_path(model, name.split("."))
        if path:
            return "body." + ".".join(path)
    return "body"


def _field_path(model: type[BaseModel], path: list[str]) -> list[str]:
    """``path`` if it names a field of ``model``; else the path to the one field of that name in
    a model one level inside it (``capacity_bytes``: ``device.capacity_bytes``); else ``[]``."""
    if _is_field_path(model, path):
        return path
    if len(path) == 1:
        inside = [
            name
            for name, field in model.model_fields.items()
            for nested in _arguments(field.annotation)
            if _is_model(nested) and path[0] in nested.model_fields
        ]
        if len(inside) == 1:
            return [inside[0], path[0]]
    return []


def _is_field_path(model: type[BaseModel], path: list[str]) -> bool:
    """Whether ``path`` names a field of ``model``, through its nested models."""
    for position, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if position == len(path) - 1:
            return True
        nested = [arg for arg in _arguments(field.annotation) if _is_model(arg)]
        if not nested:
            return False
        model = nested[0]
    return False


def _arguments(annotation: Any) -> list[Any]:
    """``annotation`` and what it is built of, one level down (``DeviceSpec | None``)."""
    return [annotation, *get_args(annotation)]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
