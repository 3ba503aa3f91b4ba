"""The ``autobatch`` command line: ``parser`` (subcommands and flags) and ``commands`` (what each
does and prints); the built-in model names are :mod:`autobatch.models`'. ``main(argv=None) ->
int`` is the entry point."""

from __future__ import annotations

from autobatch.cli._commands import main
from autobatch.cli._parser import build_parser
from autobatch.cli._plan_env import env_variables

__all__ = ["build_parser", "env_variables", "main"]
