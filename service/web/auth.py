"""Who may do what: bearer tokens, each with a role, and the Host check of a tokenless server.

Roles, each allowing what the one before it does:

- ``read``: plans and admission decisions (``POST /v1/plan``, ``POST /v1/admissions``), every
  ``GET`` (profiles, listings, devices, probe runs);
- ``publish`` as one node: ``read``, and ``POST /v1/profiles`` for profiles whose
  ``node_name`` is that node (a node cannot publish under another's name: 403 naming it);
- ``admin``: everything, ``DELETE`` and starting probe runs included.

Tokens are configured (``service.web.settings``) by ``AUTOBATCH_API_TOKEN`` (one ``admin`` token,
for a deployment without roles) and by ``AUTOBATCH_API_TOKENS_FILE``, which names either

- a file of lines ``ROLE[:NODE] TOKEN`` (``read``, ``publish:gpu-node-7``, ``admin``), blank
  lines ignored, and a ``#`` that starts a word starting a comment to the end of its line
  (``admin 9f2c... # operators``); or
- a directory, such as a Kubernetes Secret mounted as files: each file is one token (its text,
  trimmed) and its name the role: ``admin``, ``read``, ``publish.NODE``; ``read.LABEL`` and
  ``admin.LABEL`` tell several tokens of a role apart. Names starting with ``.`` (Kubernetes'
  ``..data``) are skipped.

Every token is trimmed of surrounding whitespace (a Secret written with ``echo`` ends in a
newline) and never printed: errors name the file and line, never the text. A request's token is
compared with every configured token in constant time (:func:`hmac.compare_digest`), all of them
every time, so the time taken says nothing about which matched.

Without any token, ``/v1`` is open, as it was: meant for a server on 127.0.0.1. There, a ``/v1``
request that came in on a loopback address and whose ``Host`` is not ``localhost``,
``127.0.0.1`` or ``[::1]`` (any port) is refused (403), so that a web page whose name was rebound
to 127.0.0.1 (DNS rebinding) cannot use the service through a browser.

Example::

    tokens = load_tokens(api_token=None, tokens_file=Path("/etc/autobatch/tokens"))
    grant = tokens.identify("Bearer 6f1c...")   # Grant(role='publish', node='gpu-node-7', ...)
    grant.allows(required_role("POST", "/v1/profiles"))   # True
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, get_args

from autobatch.errors import ConfigError
from service.web.settings import Settings

__all__ = [
    "GRANT_SCOPE_KEY",
    "FileToken",
    "Grant",
    "Role",
    "Tokens",
    "bearer_value",
    "central_token_source",
    "host_allowed",
    "is_loopback_server",
    "load_tokens",
    "parse_token_lines",
    "read_token_bytes",
    "read_token_directory",
    "read_token_file",
    "required_role",
    "tokens_of",
]

Role = Literal["read", "publish", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
"""In order: each role may do what those before it may."""
GRANT_SCOPE_KEY = "autobatch.grant"
"""Where the middleware leaves the request's :class:`Grant` in the ASGI scope."""
_FORMAT = "lines ROLE[:NODE] TOKEN, ROLE one of read, publish:NODE, admin"
_log = logging.getLogger("service.auth")
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})

# RFC 9110's Host: a name or IPv4 address, or an IPv6 address in brackets, then an optional port;
# nothing else (no userinfo, no path, no second port) is a host.
_HOST = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::[0-9]{1,5})?", re.ASCII)


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """One configured token and what it may do."""

    role: Role
    node: str | None
    """The node a ``publish`` token publishes as; None for the other roles."""
    source: str
    """Where it was configured (``"/etc/autobatch/tokens line 3"``), for the log."""
    token: bytes = dataclasses.field(repr=False)

    def allows(self, role: Role) -> bool:
        """Whether this grant may do what ``role`` may."""
        return ROLES.index(self.role) >= ROLES.index(role)

    @property
    def describe(self) -> str:
        """``"read"``, ``"publish as node gpu-node-7"`` or ``"admin"``."""
        return f"publish as node {self.node!r}" if self.node is not None else self.role


class Tokens:
    """The configured tokens; empty means ``/v1`` is open (tokenless).

    Raises:
        ConfigError: the same token is configured twice (both places named, not the token).
    """

    def __init__(self, grants: Sequence[Grant]) -> None:
        seen: dict[bytes, Grant] = {}
        for grant in grants:
            if grant.token in seen:
                raise ConfigError(
                    f"the same API token is configured twice ({seen[grant.token].source} and "
                    f"{grant.source}): give each role and node its own token"
                )
            seen[grant.token] = grant
        self._grants = tuple(grants)

    def __bool__(self) -> bool:
        return bool(self._grants)

    def __repr__(self) -> str:
        return f"Tokens({', '.join(grant.describe for grant in self._grants)})"

    def identify(self, authorization: str | None) -> Grant | None:
        """The grant of the token an ``Authorization: Bearer <token>`` value carries, or None.

        Compares with every configured token, in constant time each, whatever matched."""
        presented = bearer_value(authorization)
        found = None
        for grant in self._grants:
            if hmac.compare_digest(presented, grant.token) and presented:
                found = grant
        return found


def bearer_value(authorization: str | None) -> bytes:
    """The token an ``Authorization`` value carries after ``Bearer`` (trimmed); empty when
    it carries none."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip().encode("utf-8", "replace") if scheme.lower() == "bearer" else b""


def required_role(method: str, route_path: str) -> Role:
    """The role a ``/v1`` request needs, from its method and path (before its body is read)."""
    if method in ("GET", "HEAD", "OPTIONS"):
        return "read"
    if method == "POST" and route_path.rstrip("/") in ("/v1/plan", "/v1/admissions"):
        return "read"
    if method == "POST" and route_path.rstrip("/") == "/v1/profiles":
        return "publish"
    return "admin"  # DELETE, starting probe runs, and whatever comes next


def load_tokens(*, api_token: str | None, tokens_file: Path | None) -> Tokens:
    """The tokens the settings configure: ``api_token`` as ``admin``, and ``tokens_file``'s.

    Raises:
        ConfigError: the file or directory is unreadable, a line or file name is not a role,
            a token is empty, or a token is configured twice.
    """
    files = None if tokens_file is None else read_token_bytes(tokens_file)
    return tokens_of(api_token=api_token, tokens_file=tokens_file, files=files)


def read_token_bytes(path: Path) -> tuple[tuple[Path, bytes], ...]:
    """The bytes of a tokens file or directory, read once. Parse them with :func:`tokens_of`
    and hash them to see a change: what was hashed is then what is parsed.

    Returns:
        ``((path, bytes),)`` for a file; for a directory, each of its files' path and bytes,
        by name (names starting with ``.`` skipped).

    Raises:
        ConfigError: the file or directory cannot be read.
    """
    try:
        if not path.is_dir():
            return ((path, path.read_bytes()),)
        return tuple(
            (entry, entry.read_bytes())
            for entry in sorted(path.iterdir())
            if not entry.name.startswith(".") and entry.is_file()
        )
    except OSError as exc:  # the message, never the file's bytes
        raise ConfigError(f"cannot read the API tokens from {path}: {exc.strerror}") from None


def tokens_of(
    *,
    api_token: str | None,
    tokens_file: Path | None,
    files: Sequence[tuple[Path, bytes]] | None,
) -> Tokens:
    """The tokens of ``api_token`` and of ``files`` (:func:`read_token_bytes` of
    ``tokens_file``), parsed from those bytes (the file is not read again).

    Raises:
        ConfigError: as :func:`load_tokens`.
    """
    grants: list[Grant] = []
    if api_token is not None:
        grants.append(_grant("admin", None, api_token, "AUTOBATCH_API_TOKEN"))
    if tokens_file is not None and files is not None:
        if tuple(path for path, _ in files) != (tokens_file,):  # a directory's files
            grants += [_directory_grant(path, _text(path, data)) for path, data in files]
        else:
            grants += parse_token_lines(_text(tokens_file, files[0][1]), source=str(tokens_file))
    return Tokens(grants)


def parse_token_lines(text: str, *, source: str) -> list[Grant]:
    """The grants of a tokens file's ``text`` (module docstring).

    Raises:
        ConfigError: a line is not ``ROLE[:NODE] TOKEN`` (named by line, never quoted).
    """
    grants = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = _before_comment(line.split())
        if not words:
            continue
        where = f"{source} line {number}"
        if len(words) != 2:
            raise ConfigError(f"{where}: expected two words, a role and a token ({_FORMAT})")
        role, _, node = words[0].partition(":")
        grants.append(_grant(role, node if ":" in words[0] else None, words[1], where))
    return grants


def _before_comment(words: list[str]) -> list[str]:
    """The words of a line before the first that starts with ``#`` (a comment)."""
    for index, word in enumerate(words):
        if word.startswith("#"):
            return words[:index]
    return words


def read_token_directory(directory: Path) -> list[Grant]:
    """The grants of a directory of one-token files named ``ROLE[.LABEL]`` (module docstring).

    Raises:
        ConfigError: a file's name is not a role, or its token is empty or several words.
    """
    files = read_token_bytes(directory)
    return [_directory_grant(path, _text(path, data)) for path, data in files]


def _directory_grant(path: Path, text: str) -> Grant:
    """The grant of one file of a tokens directory, from its name and its ``text``."""
    role, dot, label = path.name.partition(".")
    node = label if role == "publish" and dot else None
    if role == "publish" and not dot:
        node = ""  # refused by _grant: a publish token needs its node
    return _grant(role, node, _one_token(path, text), str(path))


def read_token_file(path: Path) -> str:
    """The one token a file holds, trimmed (a Secret written with ``echo`` ends in a newline).

    Raises:
        ConfigError: the file is unreadable, empty, or holds more than one word.
    """
    return _one_token(path, _read(path))


def _one_token(path: Path, text: str) -> str:
    words = text.split()
    if len(words) != 1:
        raise ConfigError(
            f"token file {path} holds {'no token' if not words else 'several words'}; "
            "write one token, e.g. `openssl rand -hex 32 > FILE`"
        )
    return words[0]


def _read(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:  # the message, never the file's bytes
        raise ConfigError(f"cannot read the API tokens from {path}: {exc.strerror}") from None
    return _text(path, data)


def _text(path: Path, data: bytes) -> str:
    """``data`` (``path``'s bytes) as UTF-8 text.

    Raises:
        ConfigError: not UTF-8 (the file named, never its bytes).
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read the API tokens from {path}: not UTF-8 text") from None


def _grant(role: str, node: str | None, token: str, source: str) -> Grant:
    """A checked :class:`Grant` (never quoting the token, or a word that may be one)."""
    if role not in ROLES:
        raise ConfigError(f"{source}: the role is not one of {', '.join(ROLES)} ({_FORMAT})")
    if (role == "publish") != (node is not None):
        raise ConfigError(
            f"{source}: a publish token names its node (publish:NODE, or a file publish.NODE) "
            "and only a publish token does"
        )
    if node is not None and not node.strip():
        raise ConfigError(f"{source}: the node of a publish token is empty")
    secret = token.strip()
    if not secret.isprintable() or not secret.isascii() or not secret:
        raise ConfigError(f"{source}: the token is empty or holds characters a header cannot")
    return Grant(role=role, node=node, source=source, token=secret.encode())


def is_loopback_server(server: tuple[str, int] | None) -> bool:
    """Whether the connection arrived on a loopback address (the ASGI scope's ``server``)."""
    if server is None:
        return False
    try:
        return ipaddress.ip_address(server[0]).is_loopback
    except ValueError:
        return server[0] == "localhost"


def host_allowed(host: str | None) -> bool:
    """Whether a ``Host`` header names this machine's loopback (with or without a port).

    The header is parsed strictly (``host[:port]``, an IPv6 address in brackets): one that also
    holds userinfo (``localhost:8000@evil.example``), a path or anything else is not allowed.
    """
    if host is None:
        return False
    matched = _HOST.fullmatch(host.strip().lower())
    return matched is not None and matched["name"] in _LOOPBACK_NAMES


def central_token_source(settings: Settings) -> Callable[[], str | None]:
    """The token for the central service, as a function called for each request:
    ``central_api_token``, else its file's (trimmed), read again each time (a pod's projected
    service-account token rotates); None when neither is set.

    Raises:
        ConfigError: at start, the token file is unreadable or holds no single token.
    """
    if settings.central_api_token is not None:
        token = settings.central_api_token.get_secret_value()
        return lambda: token
    if settings.central_api_token_file is not None:
        return FileToken(settings.central_api_token_file)
    return lambda: None


class FileToken:
    """The token a file holds, read at every call; a read that fails keeps the last good
    token (logged), as a rotating file may be replaced between two reads.

    Raises:
        ConfigError: at construction, the file is unreadable or holds no single token.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last = read_token_file(path)

    def __call__(self) -> str:
        try:
            self._last = read_token_file(self.path)
        except ConfigError as exc:
            _log.warning("%s; sending the last token read", exc)
        return self._last
