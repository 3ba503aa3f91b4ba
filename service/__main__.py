"""``python -m service``: serve the API (``autobatch serve`` calls the same :func:`main`).

Example::

    python -m service --host 127.0.0.1 --port 8000 --config-file models.toml
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from autobatch.errors import AutobatchError
from autobatch.store import redact
from service.main import run
from service.web.problems import validation_reason
from service.web.settings import SECRET_FIELDS, add_serve_arguments, settings_from_args

__all__ = ["flag_words", "main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="autobatch serve",
        description="Serve autobatch's HTTP API. Every flag also reads AUTOBATCH_<NAME>.",
    )
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, build the settings, serve until interrupted. Returns the exit status."""
    args = parse_args(argv)
    # Registry factories ("examples.models:tiny_mlp") are found from the working directory, as
    # uvicorn finds "main:app"; spawned probe children inherit this path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        settings = settings_from_args(args)
        run(settings)
    except ValidationError as exc:
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "settings"
            flag, variable = f"--{name.replace('_', '-')}", f"AUTOBATCH_{name.upper()}"
            reason = validation_reason(error)
            if name == "store_path":  # a URL's password, masked
                reason += f" (got {redact(str(error.get('input')))!r})"
            elif name not in SECRET_FIELDS:  # never echo a secret
                reason += f" (got {error.get('input')!r})"
            print(f"autobatch serve: error: {flag} / {variable}: {reason}", file=sys.stderr)
        return 2
    except AutobatchError as exc:
        print(f"autobatch serve: error: {flag_words(str(exc))}", file=sys.stderr)
        return 1
    return 0


_KEYWORD_FLAGS = {"store": "--store-path"}
"""Library keywords ``serve`` takes under another flag than the keyword with dashes."""


def flag_words(text: str) -> str:
    """A library message with each ``keyword=VALUE`` it names as ``serve``'s flag:
    ``store=...`` reads ``--store-path ...``."""
    for keyword, flag in _KEYWORD_FLAGS.items():
        text = re.sub(rf"(?<![\w.]){keyword}=", f"{flag} ", text)
    return text


if __name__ == "__main__":
    sys.exit(main())
