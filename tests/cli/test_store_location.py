"""A mistyped store location is an error, never a new empty store: the commands that read never
create one, and `tune` creates its file only in an existing folder (the default location's
folders excepted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autobatch.cli import main
from autobatch.errors import StoreError
from autobatch.store import ProfileStore

TUNE = ["tune", "tests.service.models:tiny_mlp", "--input-shape", "32", "--device", "sim:4MiB"]
TUNE += ["--effective-batch-size", "8", "--json"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def no_store_at(path: Path, command: str = "profiles list") -> str:
    return (
        f"autobatch {command}: error: no profile store at {path}: check the location for a typo; a "
        "probe's store is created where it first stores a profile\n"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["profiles", "list"],
        ["profiles", "show", "0123456789abcdef"],
        ["profiles", "delete", "0123456789abcdef"],
        ["plan", "--profile", "0123456789abcdef", "--effective-batch-size", "8"],
    ],
    ids=["list", "show", "delete", "plan"],
)
def test_reading_a_missing_store_says_so_and_creates_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    typo = tmp_path / "profils" / "store.sqlite3"
    assert run(capsys, "--store", str(typo), *command) == (
        1,
        "",
        no_store_at(typo, " ".join(command[:2] if command[0] == "profiles" else command[:1])),
    )
    assert list(tmp_path.iterdir()) == []
    beside = tmp_path / "store.sqlite3"  # an existing folder, a missing file: the same
    assert run(capsys, "--store", str(beside), *command) == (
        1,
        "",
        no_store_at(beside, " ".join(command[:2] if command[0] == "profiles" else command[:1])),
    )
    assert list(tmp_path.iterdir()) == []


def test_reading_the_variables_missing_store_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    typo = tmp_path / "store.sqlite"
    monkeypatch.setenv("AUTOBATCH_STORE", str(typo))
    assert run(capsys, "profiles", "list") == (1, "", no_store_at(typo))
    assert not typo.exists()


def test_tune_creates_the_store_in_an_existing_folder_only(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    typo = tmp_path / "profils" / "store.sqlite3"
    code, out, err = run(capsys, "--store", str(typo), *TUNE)
    assert (code, out) == (1, "")
    assert err == (
        f"autobatch tune: error: no folder {typo.parent} for the profile store {typo}: check the "
        "location for a typo, or create the folder first\n"
    )
    assert list(tmp_path.iterdir()) == []
    store = tmp_path / "store.sqlite3"
    code, _, err = run(capsys, "--store", str(store), *TUNE)
    assert code == 0, err
    with ProfileStore(store, create="never") as opened:
        assert len(opened.list_profiles()) == 1


def test_tune_creates_the_default_locations_folders(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AUTOBATCH_STORE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, _, err = run(capsys, *TUNE)
    assert code == 0, err
    assert (tmp_path / "cache" / "autobatch" / "profiles.sqlite3").is_file()


def test_the_library_opens_as_told(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "store.sqlite3"
    with pytest.raises(StoreError, match=f"^no profile store at {deep}: "):
        ProfileStore(deep, create="never")
    with pytest.raises(StoreError, match=f"^no folder {deep.parent} for the profile store"):
        ProfileStore(deep, create="file")
    assert list(tmp_path.iterdir()) == []
    ProfileStore(deep).close()  # the default: folders and file
    assert deep.is_file()
    ProfileStore(deep, create="never").close()
    with pytest.raises(ValueError, match="create='sometimes' is not one of"):
        ProfileStore(deep, create="sometimes")  # type: ignore[arg-type]
