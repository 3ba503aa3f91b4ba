"""Where the store goes when its default location cannot be written: a private folder in the
temporary directory, else no store kept (in memory), with one warning; never no plan.

A process with a home it may not write (OpenShift runs containers under an arbitrary uid with
``HOME=/``, so the default ``~/.cache`` is ``/.cache``, which only root may create) would
otherwise fail to open the store, and every entry point (``autotune``, ``autobatch tune``, the
Lightning finder) with it. Only the default location falls back: a location given as an
argument or in ``$AUTOBATCH_STORE`` that cannot be opened stays an error naming it.

Nothing is created to find out: the default is writable when its file is, or, for a file not
there yet, when the nearest folder on its path that exists is a folder this process may write.
Imports no SQLAlchemy.

Example::

    location = default_or_fallback()     # None: the default is fine; else the place used
"""

from __future__ import annotations

import logging
import os
import pathlib
import stat
import tempfile

from autobatch.store._location import MEMORY, STORE_ENV_VAR, default_store_path

__all__ = ["default_or_fallback", "fallback_store_path", "is_writable_location"]

_log = logging.getLogger("autobatch.store")


def is_writable_location(path: pathlib.Path) -> bool:
    """Whether a SQLite store at ``path`` could be opened for writing, creating nothing.

    True when the file exists and may be read and written, or when it does not and the nearest
    existing folder on its path may be written and entered (the store creates what is missing).
    """
    if path.exists():
        return path.is_file() and os.access(path, os.R_OK | os.W_OK)
    folder = path.parent
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def fallback_store_path() -> pathlib.Path | None:
    """``$TMPDIR/autobatch-<uid>/profiles.sqlite3``, its folder created private (mode 0700);
    None when that folder cannot be made, or is not a folder this user alone owns (a link, or
    another user's: it would let them read or plant profiles)."""
    folder = pathlib.Path(tempfile.gettempdir()) / f"autobatch-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    if not private or info.st_mode & 0o077 or not os.access(folder, os.W_OK | os.X_OK):
        return None
    return folder / "profiles.sqlite3"


def default_or_fallback() -> str | None:
    """None when the store's location is given in ``$AUTOBATCH_STORE`` or its default may be
    written; else the fallback (:func:`fallback_store_path`, or ``":memory:"``: no store kept
    after the process), after one WARNING on the ``autobatch.store`` logger naming both."""
    if os.environ.get(STORE_ENV_VAR, ""):
        return None
    default = default_store_path()
    if is_writable_location(default):
        return None
    fallback = fallback_store_path()
    if fallback is not None and is_writable_location(fallback):
        _log.warning(
            "the default profile store %s cannot be created or written by this user (uid %d, "
            "HOME=%s); profiles are kept in %s instead: set %s (or XDG_CACHE_HOME) to a "
            "writable location to keep them elsewhere",
            default,
            os.getuid(),
            os.environ.get("HOME", ""),
            fallback,
            STORE_ENV_VAR,
        )
        return str(fallback)
    _log.warning(
        "the default profile store %s cannot be created or written by this user (uid %d, "
        "HOME=%s), nor a private folder in %s; profiles are kept in memory only (gone when the "
        "process ends): set %s to a writable location to keep them",
        default,
        os.getuid(),
        os.environ.get("HOME", ""),
        tempfile.gettempdir(),
        STORE_ENV_VAR,
    )
    return MEMORY
