"""The schema and every store backend agree on every bound: each stored column's integer range
holds what the schema accepts for its field, and each text column takes the longest string the
schema accepts; a profile at the bounds is stored (201) on SQLite and PostgreSQL alike, one past
them refused (422), never a 503 that a node's outbox would retry forever."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.store import ProfileStore
from autobatch.store._schema import profiles
from service.fleet.publisher import OutboxPolicy, Publisher
from service.web.schemas import ProfileCreate
from tests.service.test_publish_once import central_proxy
from tests.store.test_store import make_profile

# What each column type holds on every backend autobatch stores to (SQLite's INTEGER is 64-bit,
# PostgreSQL's integer 32-bit and bigint 64-bit; both backends' TEXT is unbounded).
_INTEGER_MAX = {sa.Integer: 2**31 - 1, sa.BigInteger: 2**63 - 1}
_INTEGER_MIN = {sa.Integer: -(2**31), sa.BigInteger: -(2**63)}


def _integer_type(column: sa.Column[Any]) -> type[sa.Integer]:
    """The column's integer type on PostgreSQL (the narrower backend)."""
    kind = column.type
    for type_ in (sa.BigInteger, sa.Integer):
        if isinstance(kind, type_):
            return type_
    raise AssertionError(f"{column.name} is not an integer column")


def test_every_stored_field_s_schema_bound_fits_its_column() -> None:
    fields = ProfileCreate.model_json_schema()["properties"]
    checked = []
    for column in profiles.columns:
        if column.name == "profile_schema_version":
            field = fields["schema_version"]
        elif column.name in fields:
            field = fields[column.name]
        else:
            continue  # set by the store (seq, id, cache_key), not by a request
        if isinstance(column.type, sa.Integer):
            kind = _integer_type(column)
            assert field["maximum"] <= _INTEGER_MAX[kind], column.name
            assert field["minimum"] >= _INTEGER_MIN[kind], column.name
        else:
            assert isinstance(column.type, sa.Text), column.name
            assert column.type.length is None, column.name  # takes any length the schema does
            assert field["type"] == "string", column.name
        checked.append(column.name)
    assert sorted(checked) == [
        "created_at",
        "device_name",
        "max_micro_batch_size",
        "model_fingerprint",
        "model_name",
        "node_name",
        "profile_schema_version",
        "recommended_micro_batch_size",
    ]


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "store.sqlite3")
    url: str = request.getfixturevalue("postgres_url")
    return url


def _body(size: int) -> dict[str, Any]:
    # No line: a line would put such a size past the card's memory (a 422 of its own).
    body = make_profile(memory_model=None).to_dict()
    body["max_micro_batch_size"] = body["recommended_micro_batch_size"] = size
    return body


def test_a_size_at_the_bound_is_stored_and_one_past_it_refused_on_every_backend(
    make_app: Callable[..., FastAPI], store_location: str
) -> None:
    client = TestClient(make_app(store_path=store_location))
    stored = client.post("/v1/profiles", json=_body(2**31 - 1))
    assert stored.status_code == 201, stored.text
    again = client.get(stored.headers["Location"]).json()
    assert again["profile"]["max_micro_batch_size"] == 2**31 - 1
    refused = client.post("/v1/profiles", json=_body(2**31))
    assert refused.status_code == 422, refused.text
    assert "max_micro_batch_size" in refused.text


def test_a_node_s_outbox_takes_out_a_profile_central_refuses_for_good(
    make_app: Callable[..., FastAPI], store_location: str, tmp_path: Path
) -> None:
    """The node's SQLite store holds a size PostgreSQL's column cannot; central answers 422 on
    either backend, and the outbox takes it out instead of retrying it forever."""
    central_app = make_app(store_path=store_location)
    policy = OutboxPolicy(base_delay_seconds=0.05, max_delay_seconds=0.4, timeout_seconds=2.0)
    profile = make_profile(max_micro_batch_size=2**31, recommended_micro_batch_size=2**31)
    with (
        central_proxy(TestClient(central_app), cut_first=False) as proxy,
        ProfileStore(tmp_path / "node.sqlite3") as node_store,
    ):
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        publisher = Publisher(url, token=None, store=node_store, policy=policy)
        publisher.submit(profile)
        publisher.open()
        try:
            deadline = time.monotonic() + 60
            while node_store.outbox.count():
                assert time.monotonic() < deadline, "the outbox kept the refused profile"
                time.sleep(0.05)
            time.sleep(0.5)  # a retry, were there one, would come within the policy's delays
        finally:
            publisher.close()
        assert len(node_store.list_profiles(limit=10)) == 1  # kept on the node
    assert proxy.statuses == [422]
    assert central_app.state.service.store.list_profiles(limit=10) == []
