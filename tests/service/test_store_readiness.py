"""``/readyz`` and the store: a store file deleted or swapped under the service is not ready."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from autobatch.profiles import ProfileStore


def test_readyz_says_when_the_store_file_was_deleted_or_replaced(
    make_app: Callable[..., Any], tmp_path: Path
) -> None:
    path = tmp_path / "served.sqlite3"
    client = TestClient(make_app(store_path=str(path)))
    assert client.get("/readyz").json()["store_writable"] is True
    path.unlink()
    gone = client.get("/readyz")
    assert gone.status_code == 503
    assert gone.json()["store_writable"] is False
    assert "was deleted" in gone.json()["store_detail"]
    assert str(tmp_path) not in gone.text  # no server path in answers

    swapped_path = tmp_path / "swapped.sqlite3"
    swapped = TestClient(make_app(store_path=str(swapped_path)))
    other = tmp_path / "other.sqlite3"
    with ProfileStore(other):
        pass
    other.replace(swapped_path)
    answer = swapped.get("/readyz")
    assert answer.status_code == 503
    assert "replaced by another file" in answer.json()["store_detail"]


def test_the_service_reads_the_one_store_variable(
    make_app: Callable[..., Any], tmp_path: Path, monkeypatch: Any
) -> None:
    from service.settings import Settings

    monkeypatch.setenv("AUTOBATCH_STORE", "postgresql://ci:s3cret@127.0.0.1:5432/fleet")
    assert Settings().store_path == "postgresql://ci:s3cret@127.0.0.1:5432/fleet"
    monkeypatch.delenv("AUTOBATCH_STORE")
    monkeypatch.setenv("AUTOBATCH_STORE_PATH", str(tmp_path / "old-name.sqlite3"))  # deprecated
    assert Settings().store_path == str(tmp_path / "old-name.sqlite3")
