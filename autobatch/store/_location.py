"""Where a profile store lives: one location string for every entry point, never a URL taken for
a path, and never a password shown.

A location is a SQLite file path, ``":memory:"``, or a URL: ``sqlite:///relative/file``,
``sqlite:////absolute/file``, ``postgresql://user:password@host:5432/database`` (the driver is
psycopg 3: ``postgresql+psycopg://`` is the same, ``postgres://`` is accepted as a synonym).
Anything of the form ``scheme://`` with another scheme is a :class:`~autobatch.errors.ConfigError`
naming the value and the fix, not a folder called ``scheme:``. Imports no SQLAlchemy.

Example::

    from autobatch.store._location import parse_location

    location = parse_location("postgresql://ci:s3cret@db:5432/autobatch")
    location.display         # 'postgresql://ci:***@db:5432/autobatch'
    parse_location(None)     # $AUTOBATCH_STORE, else ~/.cache/autobatch/profiles.sqlite3
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import urllib.parse
from typing import Literal

from autobatch.errors import ConfigError, StoreError

__all__ = [
    "STORE_ENV_VAR",
    "Create",
    "StoreLocation",
    "default_store_path",
    "parse_location",
    "password_of",
    "prepare_file",
    "redact",
]

STORE_ENV_VAR = "AUTOBATCH_STORE"
"""The one variable every entry point (library, CLI, service) reads for the store's location."""

Create = Literal["folders", "file", "never"]
"""What opening a SQLite store may create: its file and missing folders, its file in an existing
folder only, or nothing (the store must exist)."""

MEMORY = ":memory:"
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+)://")  # 2+ letters: never "C://"
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
# After the user info: host[:port][/database][?query], the host a name, IPv4 or [IPv6] address
# (or none where the query names it: ``postgresql:///db?host=/run/postgresql``, a socket).
_PG_TAIL = re.compile(
    r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+|(?=[/?][^#]*[?&]host=))(?::(?P<port>[^/?]*))?"
    r"(?P<database>/[^?]*)?(?P<query>\?.*)?",
    re.ASCII | re.DOTALL,
)
_FIX = "give a file path, ':memory:', sqlite:///PATH or postgresql://USER[:PASSWORD]@HOST[:PORT]/DB"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoreLocation:
    """A parsed store location."""

    backend: str
    """``"sqlite"`` or ``"postgresql"``."""
    path: pathlib.Path | None
    """The SQLite file; ``Path(":memory:")`` for an in-memory store; None for PostgreSQL."""
    url: str = dataclasses.field(repr=False)
    """The SQLAlchemy URL, password included: give it to a connection, never to a log."""
    display: str
    """The location as it may be shown: the path, or the URL with its password as ``***``."""

    def __post_init__(self) -> None:
        if self.backend not in ("sqlite", "postgresql"):
            raise ConfigError(f"unknown store backend {self.backend!r}; {_FIX}")

    @property
    def in_memory(self) -> bool:
        """True for a SQLite store kept in memory (gone when closed)."""
        return self.path is not None and str(self.path) == MEMORY


def default_store_path() -> pathlib.Path:
    """Where the SQLite store lives when no location is given and ``$AUTOBATCH_STORE`` is unset.

    Returns:
        ``$AUTOBATCH_STORE`` when set, non-empty and not a URL (``~`` expanded), else
        ``$XDG_CACHE_HOME/autobatch/profiles.sqlite3``, where an unset, empty or relative
        ``XDG_CACHE_HOME`` means ``~/.cache`` (as the XDG base directory spec says).
    """
    explicit = os.environ.get(STORE_ENV_VAR, "")
    if explicit and not _URL.match(explicit) and explicit != MEMORY:
        return pathlib.Path(explicit).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME", "")
    if not cache_home or not os.path.isabs(cache_home):
        cache_home = str(pathlib.Path.home() / ".cache")
    return pathlib.Path(cache_home) / "autobatch" / "profiles.sqlite3"


def parse_location(location: str | os.PathLike[str] | None) -> StoreLocation:
    """Parse a store location; None reads ``$AUTOBATCH_STORE`` (then the default file).

    Args:
        location: a SQLite file path, ``":memory:"``, a ``sqlite://`` or ``postgresql://`` URL,
            or None.

    Returns:
        The backend, the file (SQLite) and the URL to connect to.

    Raises:
        ConfigError: a URL with a scheme other than ``sqlite`` or ``postgresql`` (say
            ``mysql://``), or a PostgreSQL URL naming a driver other than psycopg, or one whose
            host or port does not parse (the message, one line, names the part and never holds
            any of the password).
    """
    if location is None:
        location = os.environ.get(STORE_ENV_VAR, "") or default_store_path()
    if isinstance(location, os.PathLike):
        return _sqlite_file(pathlib.Path(location).expanduser())
    text = location
    if text == MEMORY:
        return _sqlite_memory()
    match = _URL.match(text)
    if match is None:
        return _sqlite_file(pathlib.Path(text).expanduser())
    scheme = match["scheme"].lower()
    dialect, _, driver = scheme.partition("+")
    rest = text[match.end() :]
    if dialect == "sqlite" and driver in ("", "pysqlite"):
        # sqlite:///relative, sqlite:////absolute (SQLAlchemy's forms); sqlite:// is in memory
        if rest in ("", "/", "/" + MEMORY):
            return _sqlite_memory()
        if not rest.startswith("/"):
            raise ConfigError(
                f"store URL {redact(text)!r} names a host; SQLite takes sqlite:///relative/file "
                "or sqlite:////absolute/file"
            )
        return _sqlite_file(pathlib.Path(urllib.parse.unquote(rest[1:])).expanduser())
    if dialect in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise ConfigError(
                f"store URL {redact(text)!r} names the driver {driver!r}; autobatch talks to "
                "PostgreSQL through psycopg 3: write postgresql://... (or postgresql+psycopg://)"
            )
        url = "postgresql+psycopg://" + _checked_postgresql(rest)
        return StoreLocation(
            backend="postgresql", path=None, url=url, display=redact("postgresql://" + rest)
        )
    raise ConfigError(
        f"unknown store URL scheme {scheme!r} in {redact(text)!r} (given as store=... or "
        f"${STORE_ENV_VAR}); {_FIX}"
    )


def redact(url: str) -> str:
    """``url`` with its password as ``***``, whatever the password holds (``/``, ``:``, ``@``,
    ``?``, base64's ``+/=``), and any ``password=`` query parameter's value too.

    The user info ends at the last ``@`` (a host, port or database name holds none), so a
    password is masked whole even where a URL parser would split it; an ``@`` in a query value
    masks more than the password, never less.
    """
    match = _URL.match(url)
    if match is None:
        return url
    head, rest = url[: match.end()], url[match.end() :]
    userinfo, at, tail = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.partition(':')[0]}:***@{tail}"
    return _QUERY_PASSWORD.sub(r"\1***", head + rest)


def password_of(url: str) -> str:
    """The password in ``url``'s user info (percent-decoded), or ``""``: what to mask in a
    driver's message."""
    match = _URL.match(url)
    userinfo, at, _ = url[match.end() :].rpartition("@") if match else ("", "", "")
    return urllib.parse.unquote(userinfo.partition(":")[2]) if at and ":" in userinfo else ""


def _checked_postgresql(rest: str) -> str:
    """A PostgreSQL URL's text after ``scheme://``, checked, with each ``@``, ``?``, ``/`` and
    ``#`` in its password percent-encoded: SQLAlchemy ends the password at its first ``@`` and
    would take the rest for the host.

    The user info ends at the last ``@``, as in :func:`redact`.

    Raises:
        ConfigError: no host, a host that is no name or address, or a port that is not a number
            from 1 to 65535; the message shows the URL with its password as ``***``.
    """
    userinfo, at, tail = rest.rpartition("@")
    shown = redact("postgresql://" + rest) if at else "postgresql://" + rest
    if any(char in tail for char in "\r\n\t "):
        raise ConfigError(f"store URL {shown!r}: whitespace after the user info; {_FIX}")
    matched = _PG_TAIL.fullmatch(tail)
    if matched is None:
        what = "no host" if tail[:1] in ("", "/", ":", "?") else "a host that is no name or address"
        raise ConfigError(f"store URL {shown!r} has {what} after the user info; {_FIX}")
    port = matched["port"]
    if port is not None and not (port.isdigit() and port.isascii() and 1 <= int(port) <= 65535):
        raise ConfigError(f"store URL {shown!r}: the port is not a number from 1 to 65535; {_FIX}")
    if not at:
        return rest
    user, colon, password = userinfo.partition(":")
    if "/" in user or "?" in user or "#" in user:
        raise ConfigError(f"store URL {shown!r}: the user name holds '/', '?' or '#'; {_FIX}")
    for char, code in (("@", "%40"), ("?", "%3F"), ("/", "%2F"), ("#", "%23")):
        password = password.replace(char, code)
    return f"{user}{colon}{password}@{tail}"


def _sqlite_file(path: pathlib.Path) -> StoreLocation:
    return StoreLocation(
        backend="sqlite", path=path, url="sqlite:///" + str(path), display=str(path)
    )


def _sqlite_memory() -> StoreLocation:
    return StoreLocation(
        backend="sqlite", path=pathlib.Path(MEMORY), url="sqlite://", display=MEMORY
    )


def prepare_file(path: pathlib.Path, create: Create) -> None:
    """Check that a SQLite store's file may be opened under ``create``; make its folders when
    ``create`` is ``"folders"``.

    Raises:
        ConfigError: ``create`` is not one of the three.
        StoreError: the file (``"never"``) or its folder (``"file"``) does not exist, or the
            folders cannot be made.
    """
    if create not in ("folders", "file", "never"):
        raise ConfigError(f"create={create!r} is not one of 'folders', 'file', 'never'")
    if create == "never" and not path.exists():
        raise StoreError(
            f"no profile store at {path}: check the location for a typo; a probe's store is "
            "created where it first stores a profile"
        )
    if create == "file" and not path.parent.is_dir():
        raise StoreError(
            f"no folder {path.parent} for the profile store {path}: check the location for a "
            "typo, or create the folder first"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the directory for the profile store {path}: {exc}; "
            f"set {STORE_ENV_VAR} to a writable location"
        ) from exc
