"""Text a store backend cannot hold (a NUL, a lone surrogate) is a 422 on every backend, in
every string a request carries; ``copy_into`` copies the rows it can and reports the others."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.store import ProfileStore
from tests.store.test_store import make_profile


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "store.sqlite3")
    url: str = request.getfixturevalue("postgres_url")
    return url


def _profile(**changes: Any) -> dict[str, Any]:
    return {**make_profile().to_dict(), **changes}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"node_name": "gpu\x00node"}, "body.node_name"),
        ({"device_name": "H100\x00"}, "body.device_name"),
        ({"notes": ["fine", "a\x00b"]}, "body.notes.1"),
        ({"backend_flags": {"k\x00": "v"}}, "body.backend_flags.k\x00.[key]"),
    ],
)
def test_a_nul_in_a_profile_is_a_422_on_every_backend(
    make_app: Callable[..., FastAPI], store_location: str, change: dict[str, Any], field: str
) -> None:
    client = TestClient(make_app(store_path=store_location))
    response = client.post("/v1/profiles", json=_profile(**change))
    assert response.status_code == 422, response.text
    reasons = {error["field"]: error["reason"] for error in response.json()["errors"]}
    assert "U+0000 (NUL)" in " ".join(reasons.values()), reasons
    assert "remove that character" in " ".join(reasons.values())
    assert client.get("/v1/profile-summaries").json()["summaries"] == []


def test_a_lone_surrogate_is_a_422(make_app: Callable[..., FastAPI]) -> None:
    client = TestClient(make_app())
    body = json.dumps(_profile(node_name="x")).replace('"node_name":"x"', '"node_name":"\\ud800"')
    body = body.replace('"node_name": "x"', '"node_name": "\\ud800"')
    response = client.post(
        "/v1/profiles", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/profiles?node_name=a%00b", None),
        ("GET", "/v1/profile-summaries?model_fingerprint=%00", None),
        ("GET", "/v1/profiles/ab%00cd", None),
        ("DELETE", "/v1/profiles/ab%00cd", None),
        ("GET", "/v1/probes/ab%00cd", None),
        (
            "POST",
            "/v1/plan",
            {"model_fingerprint": "m", "card": "H\x00", "effective_batch_size": 8},
        ),
        (
            "POST",
            "/v1/plan",
            {
                "model_fingerprint": "m",
                "node": "n",
                "conditions": {"amp_dtype": "bf\x0016"},
                "effective_batch_size": 8,
            },
        ),
    ],
)
def test_a_nul_anywhere_in_a_request_is_a_422_on_every_backend(
    make_app: Callable[..., FastAPI],
    store_location: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    client = TestClient(make_app(store_path=store_location))
    response = client.request(method, path, json=body)
    assert response.status_code == 422, response.text
    assert "U+0000 (NUL)" in response.json()["detail"]


def test_strings_are_capped_from_one_constant(make_app: Callable[..., FastAPI]) -> None:
    from service.web.schemas import MAX_NAME_CHARS, MAX_TEXT_CHARS

    client = TestClient(make_app())
    long_name = _profile(node_name="n" * (MAX_NAME_CHARS + 1))
    assert client.post("/v1/profiles", json=long_name).status_code == 422
    long_note = _profile(notes=["n" * (MAX_TEXT_CHARS + 1)])
    assert client.post("/v1/profiles", json=long_note).status_code == 422
    card = {"model_fingerprint": "m", "card": "c" * (MAX_NAME_CHARS + 1), "effective_batch_size": 8}
    assert client.post("/v1/plan", json=card).status_code == 422
    assert (
        client.post("/v1/profiles", json=_profile(node_name="n" * MAX_NAME_CHARS)).status_code
        == 201
    )


def test_copy_into_copies_what_it_can_and_reports_the_rest(
    tmp_path: Path, postgres_url: str
) -> None:
    """A SQLite store holding a NUL (stored before the service refused it) moves to
    PostgreSQL: 23 of 24 rows are copied and the 24th reported; the copy does not stop at it."""
    path = tmp_path / "old.sqlite3"
    with ProfileStore(path) as source:
        ids = [source.put(make_profile(num_steps=n + 1)) for n in range(24)]
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE profiles SET node_name = 'bad' || char(0) WHERE id = ?", (ids[5],))
    uncopied: list[tuple[str, str]] = []
    with ProfileStore(path) as source, ProfileStore(postgres_url) as target:
        copied = source.copy_into(
            target, batch_size=10, on_uncopied=lambda pid, why: uncopied.append((pid, why))
        )
        assert copied == 23
        assert [pid for pid, _ in uncopied] == [ids[5]]
        assert "node_name holds U+0000 (NUL) at index 3" in uncopied[0][1]
        stored = {pid for pid, _ in target.list_profiles(limit=100)}
        assert stored == set(ids) - {ids[5]}
