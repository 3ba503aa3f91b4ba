"""The service and its store: it recovers when the store file is deleted or swapped, the
one store variable, and probe runs kept in the store across a restart."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from autobatch.store import ProfileStore
from tests.service.test_service_api import make_profile, wait_for


def test_the_service_recovers_when_its_store_file_is_deleted_or_replaced(
    make_app: Callable[..., Any], tmp_path: Path
) -> None:
    """No restart: the file at the store's path is opened again (a new store where it was
    deleted), so what is written next is where every other process looks."""
    path = tmp_path / "served.sqlite3"
    client = TestClient(make_app(store_path=str(path)))
    assert client.get("/readyz").json()["store_writable"] is True
    path.unlink()
    assert client.get("/readyz").status_code == 200
    created = client.post("/v1/profiles", json=make_profile(node_name="after").to_dict())
    assert created.status_code == 201, created.text
    with ProfileStore(path) as store:
        assert [pid for pid, _ in store.list_profiles()] == [created.json()["id"]]

    other = tmp_path / "other.sqlite3"
    with ProfileStore(other) as replacement:
        replacing = replacement.put(make_profile(node_name="replacement"))
    other.replace(path)
    listed = client.get("/v1/profiles").json()["profiles"]
    assert [entry["id"] for entry in listed] == [replacing]

    other.write_bytes(b"not a database at all" * 100)
    other.replace(path)
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert answer.json()["store_writable"] is False
    assert str(tmp_path) not in answer.text  # no server path in answers


def test_the_service_reads_the_one_store_variable(
    make_app: Callable[..., Any], tmp_path: Path, monkeypatch: Any
) -> None:
    from service.web.settings import Settings

    monkeypatch.setenv("AUTOBATCH_STORE", "postgresql://ci:s3cret@127.0.0.1:5432/fleet")
    assert Settings().store_path == "postgresql://ci:s3cret@127.0.0.1:5432/fleet"
    monkeypatch.delenv("AUTOBATCH_STORE")
    monkeypatch.setenv("AUTOBATCH_STORE_PATH", str(tmp_path / "old-name.sqlite3"))  # deprecated
    assert Settings().store_path == str(tmp_path / "old-name.sqlite3")


@pytest.mark.slow  # a spawned probe child, importing torch
def test_a_known_job_id_still_answers_after_a_restart(
    make_app: Callable[..., Any], registry_file: Path, tmp_path: Path
) -> None:
    store_path = str(tmp_path / "jobs.sqlite3")
    first = make_app(config_file=registry_file, store_path=store_path)
    client = TestClient(first)
    job_id = client.post("/v1/probes", json={"model": "tiny-mlp"}).json()["id"]
    done = wait_for(client, job_id, {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    first.state.service.runs.close()  # the server stops: its records are written
    first.state.service.store.close()
    again = TestClient(make_app(config_file=registry_file, store_path=store_path))
    answer = again.get(f"/v1/probes/{job_id}")
    assert answer.status_code == 200
    assert answer.json()["status"] == "succeeded"
    assert answer.json()["profile_id"] == done["profile_id"]
    assert again.get("/v1/probes/ffffffffffffffff").status_code == 404


def test_a_probe_run_a_restart_cut_short_reads_as_failed(
    make_app: Callable[..., Any], tmp_path: Path
) -> None:
    store_path = str(tmp_path / "jobs.sqlite3")
    with ProfileStore(store_path) as store:  # as a server killed mid-probe left it
        store.put_probe_run(
            "0123456789abcdef",
            {
                "id": "0123456789abcdef",
                "model": "tiny-mlp",
                "device": "cpu",
                "status": "running",
                "created_at": "2026-12-05T07:00:00+00:00",
                "child_pid": 4242,
            },
        )
    client = TestClient(make_app(store_path=store_path))
    answer = client.get("/v1/probes/0123456789abcdef").json()
    assert answer["status"] == "failed"
    assert "restarted while the run was running" in answer["error"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB filesystem of its own (tmpfs), so that the store's disk can really fill up;
    skips, naming why, where this process may not mount one (not root, no CAP_SYS_ADMIN)."""
    import shutil
    import subprocess

    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if shutil.which("mount")
        else None
    )
    if mounted is None or mounted.returncode != 0:
        reason = "no mount command" if mounted is None else mounted.stderr.strip()
        pytest.skip(f"cannot mount a 4 MiB tmpfs to fill a disk ({reason}): needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_readyz_says_when_the_store_s_disk_is_full(
    make_app: Callable[..., Any], small_disk: Path
) -> None:
    """The issue: /readyz said ready on a full disk, where every write answered 503."""
    app = make_app(store_path=str(small_disk / "store.sqlite3"))
    client = TestClient(app)
    assert client.get("/readyz").json()["store_writable"] is True
    filler = small_disk / "filler"
    # Fill the disk, as a runaway log would.
    with filler.open("wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    full = client.get("/readyz")
    assert full.status_code == 503
    assert full.json()["store_writable"] is False
    assert "is full" in full.json()["store_detail"]
    assert str(small_disk) not in full.text
    # Writes really fail there: a profile of ~0.4 MB finds no room.
    from tests.store.test_store import make_profile

    notes = tuple("x" * 4000 for _ in range(100))
    refused = client.post("/v1/profiles", json=make_profile(notes=notes).to_dict())
    assert refused.status_code == 503
    filler.unlink()
    assert client.get("/readyz").json()["store_writable"] is True
