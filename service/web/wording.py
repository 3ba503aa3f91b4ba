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

from autobatch.errors import AutobatchError, Remedy

__all__ = ["describe", "field_wording"]

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
    """An exception's message for a service client: remedies as JSON fields."""
    if isinstance(exc, AutobatchError):
        return exc.describe(field_wording)
    return str(exc)
