"""The CLI on the one store variable: a PostgreSQL URL is a database, never a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autobatch.cli import main
from autobatch.errors import ConfigError
from autobatch.store import ProfileStore

TINY = ["tests.service.models:tiny_mlp", "--input-shape", "32"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tune_with_a_postgres_url_in_the_variable_stores_there(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    postgres_url: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOBATCH_STORE", postgres_url)
    argv = ["tune", *TINY, "--device", "sim:4MiB", "--effective-batch-size", "64", "--json"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert json.loads(out)["plan"]["source"] == "measured"
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert json.loads(out)["plan"]["source"] == "cached"  # read back from the database
    assert list(tmp_path.iterdir()) == []  # no folder named "postgresql:"
    with ProfileStore(postgres_url) as store:
        (summary,) = store.list_summaries().summaries
    code, out, _ = run(capsys, "profiles", "list", "--json")
    assert [row["id"] for row in json.loads(out)] == [summary.id]


def test_an_unknown_scheme_is_an_error_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOBATCH_STORE", "mysql://ci:s3cret@db/profiles")
    code, _, err = run(capsys, "profiles", "list")
    assert code != 0
    assert "unknown store URL scheme 'mysql'" in err and "postgresql://" in err
    assert "s3cret" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_store_names_each_surfaces_spelling(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The library names its keyword, the CLI its --store, serve its --store-path; each the variable.
    from service.__main__ import main as serve_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AUTOBATCH_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"given as store=\.\.\. or \$AUTOBATCH_STORE"):
        ProfileStore("mysql://u@h/d")
    code, _, err = run(capsys, "--store", "mysql://u@h/d", "profiles", "list")
    assert code != 0
    assert "(given as --store ... or $AUTOBATCH_STORE)" in err and "store=" not in err
    assert serve_main(["--store-path", "mysql://u@h/d", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "(given as --store-path ... or $AUTOBATCH_STORE)" in err and "store=" not in err
    assert list(tmp_path.iterdir()) == []
