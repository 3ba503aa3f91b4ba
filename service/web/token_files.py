"""The configured tokens, reloaded when their file changes: a revoked token stops working
without a restart.

``AUTOBATCH_API_TOKENS_FILE`` (a file, or a directory such as a mounted Secret:
``service.web.auth``) is read again when a request arrives at least
:data:`RELOAD_CHECK_SECONDS` (2 s) after the last look: its bytes (every file's, for a
directory) are read once and hashed, and when they changed the tokens are parsed from those
same bytes (never a second read, which a writer truncating the file could catch empty) and
replace the old ones at once. So a token taken out of the file stops working within 2 s of the
write (within 5 s, as documented, with room to spare); a Kubernetes Secret reaches a mounted
volume up to the kubelet's sync period later (about a minute). A file that no longer parses
(or cannot be read) keeps the last good tokens in force and logs why, once per change, without
the tokens.

Once a file is configured the API stays closed: a file emptied on reload answers 401 to every
``/v1`` call, never opens the API as a server without tokens is.

Example::

    source = TokenSource(api_token=None, tokens_file=Path("/etc/autobatch/tokens"))
    source.current().identify("Bearer 6f1c...")   # Grant(...) or None, after the file's latest
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from autobatch.errors import ConfigError
from service.web.auth import Tokens, read_token_bytes, tokens_of

__all__ = ["RELOAD_CHECK_SECONDS", "TokenSource", "file_fingerprint"]

RELOAD_CHECK_SECONDS = 2.0
"""The longest a changed tokens file goes unnoticed, in seconds, while requests arrive."""

_log = logging.getLogger("service.auth")


class TokenSource:
    """``api_token`` (fixed) and ``tokens_file``'s tokens (reloaded when the file changes).

    Args:
        api_token: the ``admin`` token from ``AUTOBATCH_API_TOKEN``, or None.
        tokens_file: the tokens file or directory, or None.
        check_seconds: how long after a look the file is looked at again, seconds.
        clock: monotonic seconds (tests pass their own).

    Raises:
        ConfigError: at start, the file is unreadable or invalid (``service.web.auth``).
    """

    def __init__(
        self,
        *,
        api_token: str | None,
        tokens_file: Path | None,
        check_seconds: float = RELOAD_CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api_token = api_token
        self._file = tokens_file
        self._check_seconds = check_seconds
        self._clock = clock
        files = None if tokens_file is None else read_token_bytes(tokens_file)
        self._seen = None if files is None else _fingerprint(files)
        self._tokens = tokens_of(api_token=api_token, tokens_file=tokens_file, files=files)
        self._checked_at = clock()

    def __bool__(self) -> bool:
        """Whether ``/v1`` needs a token: any is configured, or a tokens file is."""
        return self._file is not None or bool(self._tokens)

    def current(self) -> Tokens:
        """The tokens in force now, after reloading the file when it changed."""
        now = self._clock()
        if self._file is not None and now - self._checked_at >= self._check_seconds:
            self._checked_at = now
            self._reload(self._file)
        return self._tokens

    def _reload(self, path: Path) -> None:
        """Parse the file again when its bytes changed, from the bytes hashed (read once)."""
        files: tuple[tuple[Path, bytes], ...] | None = None
        try:
            files = read_token_bytes(path)
            seen = _fingerprint(files)
        except ConfigError as exc:
            seen = f"unreadable: {exc}"
        if seen == self._seen:
            return
        self._seen = seen
        try:
            if files is None:
                raise ConfigError(seen.removeprefix("unreadable: "))
            self._tokens = tokens_of(api_token=self._api_token, tokens_file=path, files=files)
        except ConfigError as exc:
            _log.error(
                "the API tokens were not reloaded (%s); the last good ones stay in force until "
                "the file is fixed",
                exc,
            )
            return
        _log.info("the API tokens were reloaded from %s: %r", path, self._tokens)


def file_fingerprint(path: Path) -> str:
    """A SHA-256 of ``path``'s bytes, or, for a directory, of its files' names and bytes
    (names starting with ``.`` skipped, as the tokens' reader does).

    Raises:
        ConfigError: the file or directory cannot be read.
    """
    return _fingerprint(read_token_bytes(path))


def _fingerprint(files: tuple[tuple[Path, bytes], ...]) -> str:
    """A SHA-256 of :func:`~service.web.auth.read_token_bytes`' answer (names and bytes)."""
    digest = hashlib.sha256()
    for path, data in files:
        digest.update(path.name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()
