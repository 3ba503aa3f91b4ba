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

from autobatch.errors import AutobatchError, Remedy

__all__ = ["CALLS", "describe", "field_text", "field_wording"]

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


def field_wording(remedy: Remedy) -> str:
    """A remedy as the JSON field to set, e.g. ``"allow_inexact": true (plan the nearest)``."""
    if not remedy.parameter or remedy.parameter in _NO_FIELD:
        return remedy.purpose
    values = " or ".join(json.dumps(value) for value in remedy.values)
    phrase = f"{json.dumps(remedy.parameter)}: {values}"
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
