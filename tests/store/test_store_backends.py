"""The store's locations, migrations, paging and summaries, on SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import sqlite3
from typing import Any

import pytest

from autobatch.errors import ConfigError, ProfileNotFoundError, StoreError
from autobatch.store import _schema as schema
from autobatch.store._location import parse_location, redact
from autobatch.store._store import STORE_SCHEMA_VERSION, ProfileStore, profile_id_of
from tests.store.test_store import make_profile

# The exact DDL of autobatch's first store (schema version 1).
OLD_DDL = (
    """
    CREATE TABLE profiles (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        cache_key TEXT NOT NULL,
        model_fingerprint TEXT NOT NULL,
        device_name TEXT NOT NULL,
        created_at TEXT NOT NULL,
        profile_schema_version INTEGER NOT NULL,
        profile_json TEXT NOT NULL
    )
    """,
    "CREATE INDEX profiles_cache_key ON profiles (cache_key)",
    "CREATE INDEX profiles_model_fingerprint ON profiles (model_fingerprint)",
    "CREATE INDEX profiles_device_name ON profiles (device_name)",
    "PRAGMA application_id = 1098138228",
    "PRAGMA user_version = 1",
)


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "profiles.sqlite3")
    url: str = request.getfixturevalue("postgres_url")
    return url


def _old_store(path: pathlib.Path, rows: list[tuple[str, str]]) -> None:
    """A version-1 file holding ``rows`` of ``(id, profile_json)``."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for statement in OLD_DDL:
            conn.execute(statement)
        for seq, (profile_id, text) in enumerate(rows):
            data = json.loads(text) if text.startswith("{") else {}
            conn.execute(
                "INSERT INTO profiles (id, cache_key, model_fingerprint, device_name, created_at,"
                " profile_schema_version, profile_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    profile_id,
                    f"key{seq}",
                    data.get("model_fingerprint", "?"),
                    data.get("device_name", "?"),
                    f"2026-01-0{seq + 1}",
                    1,
                    text,
                ),
            )


# -- locations ------------------------------------------------------------------------------------


def test_the_schema_version_is_stated_once() -> None:
    assert STORE_SCHEMA_VERSION == schema.STORE_SCHEMA_VERSION == max(schema.MIGRATIONS)


@pytest.mark.parametrize(
    ("given", "backend", "path", "url"),
    [
        ("profiles.sqlite3", "sqlite", "profiles.sqlite3", "sqlite:///profiles.sqlite3"),
        (":memory:", "sqlite", ":memory:", "sqlite://"),
        ("sqlite://", "sqlite", ":memory:", "sqlite://"),
        ("sqlite:///rel/p.db", "sqlite", "rel/p.db", "sqlite:///rel/p.db"),
        ("sqlite:////abs/p.db", "sqlite", "/abs/p.db", "sqlite:////abs/p.db"),
        ("postgresql://u@h:5432/d", "postgresql", None, "postgresql+psycopg://u@h:5432/d"),
        ("postgres://u@h/d", "postgresql", None, "postgresql+psycopg://u@h/d"),
        ("postgresql+psycopg://u@h/d", "postgresql", None, "postgresql+psycopg://u@h/d"),
    ],
)
def test_locations_parse(given: str, backend: str, path: str | None, url: str) -> None:
    parsed = parse_location(given)
    assert (parsed.backend, parsed.url) == (backend, url)
    assert (None if parsed.path is None else str(parsed.path)) == path


def test_a_url_in_the_variable_is_never_a_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOBATCH_STORE", "postgresql://nobody@127.0.0.1:1/none")
    assert parse_location(None).backend == "postgresql"
    with pytest.raises(StoreError, match=r"postgresql://nobody@127\.0\.0\.1:1/none.*PostgreSQL"):
        ProfileStore(timeout_seconds=1)
    assert list(tmp_path.iterdir()) == []  # no folder named "postgresql:"


@pytest.mark.parametrize(
    "given", ["mysql://u@h/d", "s3://bucket/profiles", "postgresql+asyncpg://h/d"]
)
def test_other_schemes_are_a_config_error_naming_value_and_fix(
    given: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"{re.escape(given.split(':')[0])}.*postgresql://"):
        ProfileStore(given)
    assert list(tmp_path.iterdir()) == []


def test_passwords_are_never_shown() -> None:
    url = "postgresql://ci:s3cret@127.0.0.1:1/none"
    assert redact(url) == "postgresql://ci:***@127.0.0.1:1/none"
    with pytest.raises(StoreError) as caught:
        ProfileStore(url, timeout_seconds=1)
    assert "s3cret" not in str(caught.value)
    assert "ci:***@127.0.0.1:1/none" in str(caught.value)
    with pytest.raises(ConfigError) as bad:
        ProfileStore("mysql://ci:s3cret@h/d")
    assert "s3cret" not in str(bad.value)


def test_postgres_store_shows_no_password_but_shares_it(postgres_url: str) -> None:
    with_password = postgres_url.replace("postgres@", "postgres:unused@", 1)
    with ProfileStore(with_password) as store:  # trust auth ignores the password
        assert "unused" not in repr(store) and "unused" not in store.location
        assert store.shared_location() == with_password.replace(
            "postgresql://", "postgresql+psycopg://"
        )
        assert store.path is None and store.backend == "postgresql"


# -- migration ----------------------------------------------------------------------------------


def test_a_version_1_file_is_migrated_in_place(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = make_profile()
    data = old.to_dict()
    data.pop("node_name")  # schema-2 profiles had no node
    data["schema_version"] = 2
    _old_store(path, [("0123456789abcdef", json.dumps(data)), ("badbadbadbadbad0", "not json")])
    with ProfileStore(path) as store:
        assert store.get("0123456789abcdef").max_micro_batch_size == 37
        page = store.list_summaries()
        assert [s.id for s in page.summaries] == ["0123456789abcdef"]
        assert page.num_skipped == 1  # the undecodable row is skipped, not fatal
        (summary,) = page.summaries
        assert (summary.max_micro_batch_size, summary.recommended_micro_batch_size) == (37, 34)
        assert summary.node_name == "" and summary.created_at == "2026-01-01"
        assert [pid for pid, _ in store.list_profiles()] == ["0123456789abcdef"]
        assert store.num_unreadable_rows == 2
        new_id = store.put(make_profile(node_name="node-a"))
        assert [s.id for s in store.list_summaries(node_name="node-a").summaries] == [new_id]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (STORE_SCHEMA_VERSION,)
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(profiles)")}
        migrated = {row[1] for row in conn.execute("PRAGMA table_info(profiles)")}
    assert "ix_profiles_node_name" in indexes
    with ProfileStore(tmp_path / "fresh.sqlite3"):
        pass
    with contextlib.closing(sqlite3.connect(tmp_path / "fresh.sqlite3")) as conn:
        fresh = {row[1] for row in conn.execute("PRAGMA table_info(profiles)")}
    assert migrated == fresh  # a migrated store has the layout of a new one


def test_a_version_4_store_gets_model_names_in_its_summaries(location: str) -> None:
    # Version 5 adds profiles.model_name: NULL for what a version-4 store held (listed "").
    import dataclasses

    import sqlalchemy as sa

    before = make_profile()
    with ProfileStore(location) as store:
        old_id = store.put(before)
    engine = sa.create_engine(parse_location(location).url)
    with engine.begin() as conn:  # back to version 4's layout
        conn.exec_driver_sql("ALTER TABLE profiles DROP COLUMN model_name")
        conn.execute(sa.update(schema.store_meta).values(value="4"))
        if location.endswith(".sqlite3"):
            conn.exec_driver_sql("PRAGMA user_version = 4")
    engine.dispose()
    with ProfileStore(location) as store:
        named_id = store.put(dataclasses.replace(make_profile(), model_name="gpt2"))
        names = {s.id: s.model_name for s in store.list_summaries().summaries}
        assert store.get(old_id) == before
    assert names == {old_id: "", named_id: "gpt2"}


def test_a_newer_store_is_refused_and_left_untouched(location: str) -> None:
    with ProfileStore(location) as store:
        store.put(make_profile())
    import sqlalchemy as sa

    engine = sa.create_engine(parse_location(location).url)
    with engine.begin() as conn:
        conn.execute(sa.update(schema.store_meta).values(value=str(STORE_SCHEMA_VERSION + 1)))
    with engine.connect() as conn:
        before = conn.execute(sa.select(schema.profiles)).all()
    with pytest.raises(StoreError, match=rf"schema version {STORE_SCHEMA_VERSION + 1}.*upgrade"):
        ProfileStore(location)
    with engine.connect() as conn:
        assert conn.execute(sa.select(schema.profiles)).all() == before
        tables = set(sa.inspect(conn).get_table_names())
    engine.dispose()
    assert tables == {"deletions", "outbox", "profiles", "probe_jobs", "store_meta"}


# -- listings -----------------------------------------------------------------------------------


def test_summaries_page_and_filter_by_node(location: str) -> None:
    with ProfileStore(location) as store:
        ids = [
            store.put(make_profile(num_steps=n + 1, node_name=f"node-{n % 2}")) for n in range(7)
        ]
        first = store.list_summaries(limit=3)
        assert [s.id for s in first.summaries] == ids[::-1][:3]
        second = store.list_summaries(limit=3, before=first.next_before)
        third = store.list_summaries(limit=3, before=second.next_before)
        assert [s.id for s in second.summaries + third.summaries] == ids[::-1][3:]
        assert third.next_before is None
        on_node = store.list_summaries(node_name="node-1")
        assert [s.id for s in on_node.summaries] == [ids[5], ids[3], ids[1]]
        assert all(s.node_name == "node-1" for s in on_node.summaries)
        assert [pid for pid, _ in store.list_profiles(node_name="node-0", limit=2)] == [
            ids[6],
            ids[4],
        ]
        assert [pid for pid, _ in store.list_profiles(before=ids[2])] == [ids[1], ids[0]]
        with pytest.raises(ProfileNotFoundError, match="start again"):
            store.list_summaries(before="ffffffffffffffff")


def test_an_undecodable_row_is_skipped_never_failing_a_listing(location: str) -> None:
    import sqlalchemy as sa

    with ProfileStore(location) as store:
        good = store.put(make_profile())
        bad = store.put(make_profile(num_steps=9))
        engine = sa.create_engine(parse_location(location).url)
        with engine.begin() as conn:
            conn.execute(
                sa.update(schema.profiles)
                .where(schema.profiles.c.id == bad)
                .values(profile_json='{"max_micro_batch_size": "many"}')
            )
        engine.dispose()
        assert [pid for pid, _ in store.list_profiles()] == [good]
        assert store.find(make_profile().cache_key()) == (good, make_profile())
        assert store.num_unreadable_rows == 2
        assert [s.id for s in store.list_summaries().summaries] == [bad, good]  # columns intact
        with pytest.raises(StoreError, match=rf"cannot read profile '{bad}'"):
            store.get(bad)


def test_summaries_carry_the_indexed_columns(location: str) -> None:
    profile = make_profile(node_name="gpu-node-7", device_name="NVIDIA H100 80GB HBM3")
    with ProfileStore(location) as store:
        store.put(profile)
        (summary,) = store.list_summaries().summaries
    expected: dict[str, Any] = {
        "id": profile_id_of(profile),
        "cache_key": profile.cache_key(),
        "model_fingerprint": "model-a",
        "device_name": "NVIDIA H100 80GB HBM3",
        "node_name": "gpu-node-7",
        "max_micro_batch_size": 37,
        "recommended_micro_batch_size": 34,
        "created_at": "2026-05-09T07:35:25+00:00",
    }
    assert {name: getattr(summary, name) for name in expected} == expected


# -- readiness ----------------------------------------------------------------------------------


def test_a_deleted_or_replaced_file_is_opened_again(tmp_path: pathlib.Path) -> None:
    """Writes go where every other process (and a restart) will look, not to an unlinked file."""
    path = tmp_path / "profiles.sqlite3"
    with ProfileStore(path) as store:
        store.put(make_profile(node_name="before"))
        path.unlink()
        store.check_writable()
        kept = store.put(make_profile(node_name="after"))
        with ProfileStore(path) as fresh:
            assert [pid for pid, _ in fresh.list_profiles()] == [kept]

        other = tmp_path / "other.sqlite3"
        with ProfileStore(other) as replacement:
            replacing = replacement.put(make_profile(node_name="replacement"))
        other.replace(path)
        assert [pid for pid, _ in store.list_profiles()] == [replacing]

        with sqlite3.connect(other) as foreign:
            foreign.execute("CREATE TABLE notes (text TEXT)")
        foreign.close()
        other.replace(path)
        with pytest.raises(StoreError, match="not an autobatch profile store"):
            store.check_writable()


def test_check_writable_on_postgres(postgres_url: str) -> None:
    with ProfileStore(postgres_url) as store:
        store.check_writable()
        profile_id = store.put(make_profile())
        store.check_writable()
        assert [pid for pid, _ in store.list_profiles()] == [profile_id]


def test_importing_the_store_does_not_import_sqlalchemy() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from autobatch import ProfileStore; import autobatch.store;"
            "print('sqlalchemy' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["False"]


def test_an_old_sqlite_store_copies_into_postgres(
    tmp_path: pathlib.Path, postgres_url: str
) -> None:
    path = tmp_path / "old.sqlite3"
    data = make_profile().to_dict()
    data.pop("node_name")
    _old_store(path, [("0123456789abcdef", json.dumps(data)), ("badbadbadbadbad0", "not json")])
    with ProfileStore(path) as source, ProfileStore(postgres_url) as target:
        newer = [source.put(make_profile(num_steps=n + 1, node_name="n1")) for n in range(7)]
        assert source.copy_into(target, batch_size=3) == 9
        assert source.copy_into(target, batch_size=3) == 0  # run again: nothing new
        assert target.list_summaries() == source.list_summaries()
        assert target.get("0123456789abcdef") == source.get("0123456789abcdef")
        assert [pid for pid, _ in target.list_profiles(node_name="n1")] == newer[::-1]
        with pytest.raises(ConfigError, match="batch_size 0"):
            source.copy_into(target, batch_size=0)


def test_probe_run_records_are_kept_and_replaced(location: str) -> None:
    with ProfileStore(location) as store:
        assert store.get_probe_run("j1") is None
        store.put_probe_run("j1", {"id": "j1", "status": "queued"})
        store.put_probe_run("j1", {"id": "j1", "status": "succeeded", "profile_id": "abc"})
        store.put_probe_run("j2", {"id": "j2", "status": "running"})
        assert store.get_probe_run("j1") == {"id": "j1", "status": "succeeded", "profile_id": "abc"}
        assert store.get_probe_run("j2") == {"id": "j2", "status": "running"}


def test_latest_per_node_keeps_a_few_things_of_each_node_so_no_node_crowds_the_others_out(
    location: str,
) -> None:
    # Node A claims a new thing measured with each profile (a card's memory one byte apart:
    # a new cache key each time), 40 of them after the honest nodes published: it keeps its
    # 32 newest, and the honest three still stand within a limit of 40.
    from autobatch.store._latest import PER_NODE_KEYS

    with ProfileStore(location) as store:
        honest = [
            store.put(make_profile(node_name=node, model_fingerprint="fp-flood"))
            for node in ("node-b", "node-c", "node-d")
        ]
        for index in range(40):
            store.put(
                make_profile(
                    node_name="node-a",
                    model_fingerprint="fp-flood",
                    total_memory_bytes=80 * 2**30 + index,
                )
            )
        found = store.latest_per_node(model_fingerprint="fp-flood", limit=40)
    nodes = [profile.node_name for _, profile in found]
    assert nodes.count("node-a") == PER_NODE_KEYS == 32
    assert sorted(i for i, p in found if p.node_name != "node-a") == sorted(honest)
    assert len(found) == 35
