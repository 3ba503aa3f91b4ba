"""Optional dependencies: each feature that needs one imports it here, so that a missing one is
one line naming the extra that installs it, not a ``ModuleNotFoundError`` traceback.

The extras are pyproject.toml's ``[project.optional-dependencies]``. They are installed from the
checkout (``pip install -e '.[postgres]'``): the name ``autobatch`` on PyPI is another project's.

Example::

    from autobatch.extras import require

    psycopg = require("psycopg", extra="postgres", purpose="a PostgreSQL profile store")
    # MissingExtraError: a PostgreSQL profile store needs the 'postgres' extra (psycopg is not
    # installed): pip install -e '.[postgres]' in the autobatch checkout
"""

from __future__ import annotations

import contextlib
import importlib
import random
import sys
import types
from collections.abc import Iterator

from autobatch.errors import MissingExtraError

__all__ = ["EXTRAS", "install_hint", "keeping_rng", "needs_extra", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers", "accelerate"),
    "lightning": ("lightning", "torchmetrics"),
    "models": ("transformers",),
    "postgres": ("psycopg",),
    "service": ("fastapi", "uvicorn", "pydantic", "pydantic_settings", "prometheus_client"),
}
"""Each extra's top-level modules, as imported (pyproject.toml names their distributions)."""


def install_hint(extra: str) -> str:
    """How to install ``extra``: ``pip install -e '.[postgres]' in the autobatch checkout``."""
    return f"pip install -e '.[{extra}]' in the autobatch checkout"


@contextlib.contextmanager
def needs_extra(extra: str, *, purpose: str, module: str = "") -> Iterator[None]:
    """Imports in this block that fail for want of ``extra`` raise :class:`MissingExtraError`.

    For imports that must stay ``import`` statements (module level, typed names)::

        with needs_extra("lightning", purpose="autobatch.integrations.lightning"):
            from lightning.pytorch.callbacks import Callback

    Args:
        extra: the extra that installs the modules, a key of :data:`EXTRAS`.
        purpose: what needs them, the subject of the message.
        module: one more module the extra stands for (the one :func:`require` imports).

    Raises:
        MissingExtraError: a module of ``extra`` (or ``module``) cannot be imported. An
            ``ImportError`` of anything else (a broken install) propagates as it is.
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {sorted(EXTRAS)}")
    try:
        yield
    except ImportError as exc:
        missing = exc.name or module
        root = missing.partition(".")[0]
        if root != module.partition(".")[0] and root not in EXTRAS[extra]:
            raise
        if root in EXTRAS[extra]:
            missing = root  # the distribution to install, not one of its submodules
        raise MissingExtraError(
            f"{purpose} needs the '{extra}' extra ({missing} is not installed): "
            f"{install_hint(extra)}",
            extra=extra,
            module=missing,
        ) from exc


def require(module: str, *, extra: str, purpose: str) -> types.ModuleType:
    """Import ``module``, or say which extra installs it.

    Args:
        module: what to import, e.g. ``"psycopg"`` or ``"service.__main__"``.
        extra: the extra that installs it (or the modules it imports), a key of :data:`EXTRAS`.
        purpose: what needs it, the subject of the message (``"a PostgreSQL profile store"``).

    Returns:
        The module.

    Raises:
        MissingExtraError: as :func:`needs_extra`.
    """
    with needs_extra(extra, purpose=purpose, module=module), keeping_rng():
        return importlib.import_module(module)
    raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises


@contextlib.contextmanager
def keeping_rng() -> Iterator[None]:
    """Leave Python's ``random`` state (and numpy's global one, where numpy is imported) as it
    was before the block: put around each import autobatch makes lazily.

    autobatch imports on first use what a call needs (``autobatch.autotune`` the tuning road, a
    drop-in its framework, a remote the HTTP client), and a library may draw at import (rich,
    which httpx imports, calls ``random.getrandbits``): a seeded script's draws would then differ
    with and without autobatch, where the probe promises the RNG states as they were.

    Example::

        with keeping_rng():
            from autobatch.client import service_remote
    """
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
