"""A default store location that cannot be written falls back: a non-root user with
HOME=/ (OpenShift's arbitrary uid) plans through every road, with one warning each; a location
given explicitly that cannot be opened stays an error naming it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from autobatch.errors import StoreError
from autobatch.store._fallback import default_or_fallback, is_writable_location
from autobatch.store._store import ProfileStore

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534

_LIST_AS = """\
import json, os, sys
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
unreadable = []
for folder in sys.argv[2:]:
    try:
        os.listdir(folder)
    except OSError:
        unreadable.append(folder)
print(json.dumps(unreadable))
"""


def unreadable_by(uid: int, folders: Sequence[Path]) -> list[str]:
    """Which of ``folders`` ``uid`` cannot list (a private folder on the way, e.g. a clone under
    a 0700 folder), tried in a child of this interpreter that becomes ``uid`` as the worker does.
    Needs root."""
    done = subprocess.run(
        [sys.executable, "-c", _LIST_AS, str(uid), *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    unreadable: list[str] = json.loads(done.stdout)
    return unreadable


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory another uid may write (pytest's own is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="autobatch-fallback-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another uid needs root")
def test_a_folder_another_uid_cannot_list_is_named(shared_tmp: Path) -> None:
    (shared_tmp / "open").mkdir(mode=0o755)
    (shared_tmp / "closed" / "inside").mkdir(parents=True, mode=0o755)
    (shared_tmp / "closed").chmod(0o700)
    folders = [shared_tmp / "open", shared_tmp / "closed" / "inside", shared_tmp]
    assert unreadable_by(NOBODY, folders) == [str(shared_tmp / "closed" / "inside")]


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another uid needs root")
def test_a_non_root_user_with_home_slash_plans_through_every_road(shared_tmp: Path) -> None:
    # autotune, `autobatch tune` and the Lightning finder, as a uid whose HOME=/ has no .cache.
    # The worker imports lazily after it becomes that uid: the project and its packages must
    # be readable by it.
    unreadable = unreadable_by(NOBODY, [ROOT / "autobatch", Path(sysconfig.get_paths()["purelib"])])
    if unreadable:
        pytest.skip(
            f"uid {NOBODY} cannot read {', '.join(unreadable)} (a folder above is private to "
            "its owner, e.g. a clone under a 0700 folder), and the worker imports from there "
            "after it becomes that uid"
        )
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "AUTOBATCH_STORE")}
    env.update(HOME="/", TMPDIR=str(shared_tmp), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("unwritable_home_worker.py")), str(NOBODY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert (results["uid"], results["home"]) == (NOBODY, "/")
    fallback = shared_tmp / f"autobatch-{NOBODY}" / "profiles.sqlite3"
    for road in ("autotune", "cli", "finder"):
        assert results[road].get("answer") == 64, results[road]  # micro x steps, one rank
        (warning,) = results[road]["warnings"]
        assert warning.startswith(
            "the default profile store /.cache/autobatch/profiles.sqlite3 cannot be created or "
            f"written by this user (uid {NOBODY}, HOME=/); profiles are kept in {fallback} instead"
        )
    assert fallback.is_file() and fallback.stat().st_uid == NOBODY
    assert fallback.parent.stat().st_mode & 0o777 == 0o700


@pytest.fixture
def unwritable_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Path]]:
    """The default location lies under a file (no user may create it); the temporary
    directory is ``tmp_path/tmp``."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.delenv("AUTOBATCH_STORE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    yield blocker, temporary


def test_the_default_falls_back_to_a_private_folder_with_one_warning(
    unwritable_default: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    blocker, temporary = unwritable_default
    assert not is_writable_location(blocker / "autobatch" / "profiles.sqlite3")
    caplog.set_level(logging.WARNING, logger="autobatch.store")

    with ProfileStore() as store:
        assert store.path == temporary / f"autobatch-{os.getuid()}" / "profiles.sqlite3"
        assert store.list_profiles() == []

    (record,) = caplog.records
    assert f"{blocker}/autobatch/profiles.sqlite3 cannot be created" in record.getMessage()
    assert f"kept in {store.path} instead" in record.getMessage()
    assert (temporary / f"autobatch-{os.getuid()}").stat().st_mode & 0o777 == 0o700


def test_a_fallback_folder_that_is_not_this_user_s_own_is_no_store_at_all(
    unwritable_default: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, temporary = unwritable_default
    elsewhere = temporary / "elsewhere"
    elsewhere.mkdir()
    (temporary / f"autobatch-{os.getuid()}").symlink_to(elsewhere)  # planted by someone else
    caplog.set_level(logging.WARNING, logger="autobatch.store")

    assert default_or_fallback() == ":memory:"
    (record,) = caplog.records
    assert "profiles are kept in memory only (gone when the process ends)" in (record.getMessage())
    assert list(elsewhere.iterdir()) == []


def test_only_the_default_falls_back(
    unwritable_default: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocker, _ = unwritable_default
    explicit = blocker / "store.sqlite3"
    with pytest.raises(StoreError, match=f"profile store {explicit}"):
        ProfileStore(explicit)
    monkeypatch.setenv("AUTOBATCH_STORE", str(explicit))
    with pytest.raises(StoreError, match=f"profile store {explicit}"):
        ProfileStore()
    assert default_or_fallback() is None
    assert caplog.records == []


def test_a_writable_default_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOBATCH_STORE", raising=False)
    assert default_or_fallback() is None
    assert not (tmp_path / "cache").exists()  # finding out created nothing
    with ProfileStore() as store:
        assert store.path == tmp_path / "cache" / "autobatch" / "profiles.sqlite3"
