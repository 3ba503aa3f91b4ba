"""A store URL that does not parse is one line naming the part that is wrong, and no part of its
password: from the library, the CLI (the flag before or after the command) and ``autobatch
serve``; one whose password holds ``?``, ``@``, ``/`` or ``#`` parses whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from autobatch.cli import main
from autobatch.errors import ConfigError
from autobatch.store import parse_location

ROOT = Path(__file__).resolve().parents[2]
SECRET = "SECRETTAIL"

MALFORMED = {
    "a bad port": (f"postgresql://u:Pq?x@y:{SECRET}@host:99999/db", "the port"),
    "a port that is a word": (f"postgresql://u:{SECRET}@host:port/db", "the port"),
    "a port of zero": (f"postgresql://u:{SECRET}@host:0/db", "the port"),
    "an empty port": (f"postgresql://u:{SECRET}@host:/db", "the port"),
    "no host": (f"postgresql://u:{SECRET}@/db", "no host"),
    "no host before the port": (f"postgresql://u:S?E@{SECRET}@:5432/db", "no host"),
    "a host with a space": (f"postgresql://u:{SECRET}@my host/db", "whitespace"),
    "a host that is no name": (f"postgresql://u:{SECRET}@ho%st/db", "no name or address"),
}


@pytest.mark.parametrize(("url", "part"), MALFORMED.values(), ids=list(MALFORMED))
def test_a_malformed_url_names_the_part_and_no_password(url: str, part: str) -> None:
    with pytest.raises(ConfigError, match=part) as raised:
        parse_location(url)
    message = str(raised.value)
    assert "\n" not in message
    assert "SECRET" not in message and "TAIL" not in message and "Pq" not in message
    assert "postgresql://u:***@" in message


@pytest.mark.parametrize(
    ("url", "password"),
    [
        (f"postgresql://u:Pq?x@y:{SECRET}@host:5432/db", f"Pq?x@y:{SECRET}"),
        ("postgresql://u:a/b#c@host/db", "a/b#c"),
        ("postgresql://u:p@[::1]:5432/db?sslmode=require", "p"),
    ],
)
def test_a_password_holding_url_delimiters_parses_whole(url: str, password: str) -> None:
    parsed = make_url(parse_location(url).url)
    assert parsed.password == password
    assert parsed.database == "db"
    assert parsed.host in ("host", "::1")


def test_a_socket_url_without_a_host_still_parses() -> None:
    url = parse_location("postgresql:///db?host=/run/postgresql").url
    assert url == "postgresql+psycopg:///db?host=/run/postgresql"


def _cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize(("url", "part"), MALFORMED.values(), ids=list(MALFORMED))
def test_the_cli_prints_one_error_line_without_the_password(
    capsys: pytest.CaptureFixture[str], url: str, part: str
) -> None:
    code, text = _cli(capsys, ["--store", url, "profiles", "list"])
    assert code != 0
    # one line, and the pointer to --help argparse gives its own refusals
    assert part in text and len(text.strip().splitlines()) <= 2, text
    assert text.strip().splitlines()[1:] in ([], ["try 'autobatch profiles list --help'"]), text
    assert SECRET not in text and "Traceback" not in text
    # The flag after the command is refused naming where it goes, the password masked.
    code, text = _cli(capsys, ["profiles", "list", "--store", url])
    assert code != 0 and "--store goes before the command" in text
    assert SECRET not in text and "u:***@" in text


def test_serve_prints_one_line_without_the_password(tmp_path: Path) -> None:
    for url, part in MALFORMED.values():
        env = {**os.environ, "AUTOBATCH_STORE": url, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "autobatch", "serve", "--port", "0"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        text = done.stdout + done.stderr
        assert part in text and len(text.strip().splitlines()) == 1, text
        assert SECRET not in text and "Traceback" not in text
