"""``autobatch serve --help``: every flag shows the default serve uses, in one style."""

from __future__ import annotations

import argparse
import re

from service.web.settings import Settings, add_serve_arguments


def test_every_serve_flag_shows_its_default_in_one_style() -> None:
    parser = argparse.ArgumentParser(prog="autobatch serve")
    add_serve_arguments(parser)
    helps = {a.dest: a.help or "" for a in parser._actions if a.dest in Settings.model_fields}
    assert set(helps) == set(Settings.model_fields)  # a flag per setting
    shown = {
        name: re.findall(r"\(default: ([^()]*(?:\([^()]*\))?[^()]*)\)$", text)
        for name, text in helps.items()
    }
    assert all(len(found) == 1 for found in shown.values()), shown
    # No second, older spelling left in a help: "(default 2)", "(30)".
    assert not [t for t in helps.values() if re.search(r"\(default \d|\(\d+\)", t)], helps
    assert shown["max_body_bytes"] == ["1048576"]
    assert shown["probe_timeout_seconds"] == ["1800"]
    assert shown["max_queued_probes"] == ["8"]
    assert shown["nvml_timeout_seconds"] == ["2"]
    assert shown["require_gpu"] == ["off"] and shown["api_token"] == ["none"]
