"""Text every store backend can hold: the one check, for the service's input and for copies.

PostgreSQL's ``text`` cannot hold U+0000 (NUL), which SQLite stores; neither can hold a lone
surrogate (U+D800..U+DFFF: not encodable as UTF-8). A profile with such a character would be
stored on one backend and refused by the other, so it is refused everywhere: the service answers
422 for it (``service.web.schemas``) and :meth:`~autobatch.store.ProfileStore.copy_into` reports
the rows that hold one instead of failing on them. Imports nothing beyond the standard library.

Example::

    unstorable("gpu\\x00node")      # 'holds U+0000 (NUL) at index 3, which PostgreSQL cannot store'
    unstorable_in({"notes": ["ok"]})  # None
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["unstorable", "unstorable_in"]

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable(text: str) -> str | None:
    """Why ``text`` cannot be stored on every backend, or None when it can.

    Returns:
        The first offending character, its index and why, e.g. ``"holds U+0000 (NUL) at index
        3, which PostgreSQL cannot store"``.
    """
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    code = ord(found.group())
    if code == 0:
        return f"holds U+0000 (NUL) at index {found.start()}, which PostgreSQL cannot store"
    return (
        f"holds a lone surrogate U+{code:04X} at index {found.start()}, which is not valid "
        "UTF-8 and no store can hold"
    )


def unstorable_in(value: Any, *, where: str = "") -> str | None:
    """The first string (key or value) in a JSON value that cannot be stored, with its path.

    Args:
        value: a JSON value (dicts, lists, strings, numbers, booleans, None).
        where: the path of ``value`` itself, for the message.

    Returns:
        e.g. ``"notes[2] holds U+0000 (NUL) at index 3, which PostgreSQL cannot store"``, or
        None when every string can be stored.
    """
    if isinstance(value, str):
        why = unstorable(value)
        return None if why is None else f"{where or 'the value'} {why}"
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and (why := unstorable(key)) is not None:
                return f"the key {path!r} {why}"
            if (found := unstorable_in(item, where=path)) is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if (found := unstorable_in(item, where=f"{where}[{index}]")) is not None:
                return found
    return None
