"""Tests for autobatch.store._store: round trips, ordering, schema guards, concurrency."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import pathlib
import re
import sqlite3
import threading
from typing import Any

import pytest

from autobatch.conditions import Conditions
from autobatch.errors import ConfigError, ProfileNotFoundError, StoreError
from autobatch.profile import PROFILE_SCHEMA_VERSION, MemoryModel, Profile, StepIdentity, Trial
from autobatch.store._store import (
    STORE_SCHEMA_VERSION,
    ProfileStore,
    default_store_path,
    profile_id_of,
)

GIB = 2**30


def make_profile(**overrides: Any) -> Profile:
    """A probe result with trials, a memory model and every mapping field filled in."""
    fields: dict[str, Any] = {
        "max_micro_batch_size": 37,
        "recommended_micro_batch_size": 34,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (
            Trial(
                micro_batch_size=32,
                fits=True,
                peak_allocated_bytes=int(1.5 * GIB),
                peak_reserved_bytes=int(1.6 * GIB),
                step_seconds=0.125,
            ),
            Trial(micro_batch_size=40, fits=False, oom=True, error="CUDA out of memory"),
            Trial(
                micro_batch_size=37,
                fits=True,
                peak_allocated_bytes=int(1.9 * GIB),
                peak_reserved_bytes=2 * GIB - 4096,
                step_seconds=0.14,
            ),
        ),
        "num_steps": 5,
        "device_name": "sim",
        "device_type": "sim",
        "total_memory_bytes": 2 * GIB,
        "capacity_bytes": 2 * GIB,
        "memory_model": MemoryModel(fixed_bytes=500 * 2**20, bytes_per_sample=40 * 2**20),
        "stop_reason": "boundary found between 37 and 40",
        "notes": ("estimate calibrated against 1 trial",),
        "torch_version": "2.13.0",
        "dtype": "float32",
        "amp_dtype": "bfloat16",
        "optimizer": "AdamW",
        "input_shape": {"input_ids": (512,), "labels": (512,)},
        "model_fingerprint": "model-a",
        "backend_flags": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        "created_at": "2026-05-09T07:35:25+00:00",
    }
    fields.update(overrides)
    identity = {k: fields.pop(k) for k in list(fields) if k in StepIdentity.__dataclass_fields__}
    return Profile(**fields, identity=StepIdentity(**identity))


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Any:
    """The store contract runs on both backends (PostgreSQL: a fresh database per test)."""
    if request.param == "sqlite":
        location = str(tmp_path / "profiles.sqlite3")
    else:
        location = request.getfixturevalue("postgres_url")
    with ProfileStore(location) as opened:
        yield opened


@pytest.fixture
def sqlite_store(tmp_path: pathlib.Path) -> Any:
    with ProfileStore(tmp_path / "profiles.sqlite3") as opened:
        yield opened


def _raw(path: pathlib.Path) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(path, isolation_level=None))


# -- default path -------------------------------------------------------------------------------


def test_default_path_honours_autobatch_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("AUTOBATCH_STORE", str(tmp_path / "x" / "store.db"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store_path() == tmp_path / "x" / "store.db"


def test_default_path_uses_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("AUTOBATCH_STORE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store_path() == tmp_path / "xdg" / "autobatch" / "profiles.sqlite3"


@pytest.mark.parametrize("xdg", [None, "", "relative/cache"])
def test_default_path_falls_back_to_home_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, xdg: str | None
) -> None:
    monkeypatch.delenv("AUTOBATCH_STORE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    expected = tmp_path / "home" / ".cache" / "autobatch" / "profiles.sqlite3"
    assert default_store_path() == expected


def test_store_without_path_opens_env_path_and_creates_parents(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    target = tmp_path / "deep" / "er" / "store.sqlite3"
    monkeypatch.setenv("AUTOBATCH_STORE", str(target))
    with ProfileStore() as store:
        assert store.path == target
        profile_id = store.put(make_profile())
    assert target.is_file()
    with ProfileStore(target) as reopened:
        assert reopened.get(profile_id) == make_profile()


# -- round trip, lookup, ordering ---------------------------------------------------------------


def test_put_get_round_trip_is_equal(store: ProfileStore) -> None:
    profile = make_profile()
    profile_id = store.put(profile)
    loaded = store.get(profile_id)
    assert loaded == profile
    assert loaded.trials[1] == Trial(
        micro_batch_size=40, fits=False, oom=True, error="CUDA out of memory"
    )
    assert loaded.memory_model == MemoryModel(fixed_bytes=500 * 2**20, bytes_per_sample=40 * 2**20)
    assert loaded.input_shape == {"input_ids": (512,), "labels": (512,)}
    assert loaded.num_ooms == 1
    assert loaded.cache_key() == profile.cache_key()


def test_round_trip_without_memory_model(store: ProfileStore) -> None:
    profile = make_profile(memory_model=None, trials=(), notes=(), input_shape={})
    assert store.get(store.put(profile)) == profile


def test_ids_are_content_hashes_and_put_is_idempotent(store: ProfileStore) -> None:
    ids = [store.put(make_profile(num_steps=n + 1)) for n in range(20)]
    assert len(set(ids)) == 20
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    assert ids[3] == profile_id_of(make_profile(num_steps=4))
    again = [store.put(make_profile(num_steps=n + 1)) for n in range(20)]  # a publisher retries
    assert again == ids
    listed = store.list_profiles(limit=1000)
    assert len(listed) == 20
    assert [pid for pid, _ in listed] == ids[::-1]  # a no-op put does not make a row newer


def test_get_missing_raises_not_found(store: ProfileStore) -> None:
    store.put(make_profile())
    with pytest.raises(
        ProfileNotFoundError, match=rf"no profile with id 'nope' in {re.escape(store.location)}$"
    ) as e:
        store.get("nope")
    assert isinstance(e.value, KeyError)
    assert isinstance(e.value, StoreError)
    assert e.value.profile_id == "nope"
    assert str(e.value).startswith("no profile with id 'nope'")


def test_find_returns_newest_with_that_cache_key(store: ProfileStore) -> None:
    first = make_profile(max_micro_batch_size=30, recommended_micro_batch_size=28)
    other = make_profile(model_fingerprint="model-b")
    second = make_profile(max_micro_batch_size=31, recommended_micro_batch_size=29)
    assert first.cache_key() == second.cache_key() != other.cache_key()
    store.put(first)
    second_id = store.put(second)
    other_id = store.put(other)
    assert store.find(first.cache_key()) == (second_id, second)
    assert store.find(other.cache_key()) == (other_id, other)
    assert store.find(make_profile(device_name="NVIDIA H200").cache_key()) is None


def test_list_is_newest_first_and_filters(store: ProfileStore) -> None:
    stored = []
    for index in range(6):
        profile = make_profile(
            max_micro_batch_size=10 + index,
            recommended_micro_batch_size=10,
            model_fingerprint="model-a" if index % 2 == 0 else "model-b",
            device_name="sim" if index < 3 else "NVIDIA H200",
        )
        stored.append((store.put(profile), profile))
    newest_first = stored[::-1]
    assert store.list_profiles() == newest_first
    assert store.list_profiles(limit=2) == newest_first[:2]
    assert store.list_profiles(model_fingerprint="model-a") == [stored[4], stored[2], stored[0]]
    assert store.list_profiles(device_name="NVIDIA H200") == [stored[5], stored[4], stored[3]]
    assert store.list_profiles(model_fingerprint="model-b", device_name="sim") == [stored[1]]
    assert store.list_profiles(model_fingerprint="unknown") == []


def test_list_rejects_limit_below_one(store: ProfileStore) -> None:
    with pytest.raises(ConfigError, match="limit 0 must be >= 1"):
        store.list_profiles(limit=0)


def test_delete_returns_whether_it_removed(store: ProfileStore) -> None:
    keep = store.put(make_profile())
    gone = store.put(make_profile(num_steps=7))
    assert store.delete(gone) is True
    assert store.delete(gone) is False
    assert store.delete("never-stored") is False
    with pytest.raises(ProfileNotFoundError):
        store.get(gone)
    assert [pid for pid, _ in store.list_profiles()] == [keep]


def test_empty_created_at_is_indexed_with_store_time(sqlite_store: ProfileStore) -> None:
    profile = make_profile(created_at="")
    profile_id = sqlite_store.put(profile)
    assert sqlite_store.get(profile_id) == profile  # the profile itself is stored unchanged
    with _raw(sqlite_store.path) as conn:
        (created_at,) = conn.execute(
            "SELECT created_at FROM profiles WHERE id = ?", (profile_id,)
        ).fetchone()
    assert created_at.startswith("20") and created_at.endswith("+00:00")


def test_in_memory_store() -> None:
    with ProfileStore(":memory:") as store:
        profile_id = store.put(make_profile())
        assert store.get(profile_id) == make_profile()
        store.check_writable()
        assert str(store.path) == ":memory:"


def test_file_uses_wal_and_records_schema_version(sqlite_store: ProfileStore) -> None:
    sqlite_store.put(make_profile())
    with _raw(sqlite_store.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA user_version").fetchone() == (STORE_SCHEMA_VERSION,)


def test_closed_store_raises_and_close_is_idempotent(tmp_path: pathlib.Path) -> None:
    store = ProfileStore(tmp_path / "s.sqlite3")
    store.close()
    store.close()
    with pytest.raises(StoreError, match="is closed"):
        store.put(make_profile())
    with ProfileStore(tmp_path / "t.sqlite3") as managed:
        pass
    with pytest.raises(StoreError, match="is closed"):
        managed.list_profiles()


# -- schema guards: never overwrite or migrate silently -----------------------------------------


def test_newer_store_schema_is_refused_and_left_unchanged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "newer.sqlite3"
    with ProfileStore(path) as store:
        store.put(make_profile())
    with _raw(path) as conn:
        conn.execute(f"PRAGMA user_version = {STORE_SCHEMA_VERSION + 1}")
        conn.execute("PRAGMA journal_mode = DELETE")  # fold the WAL in: the file is all there is
    before = path.read_bytes()
    with pytest.raises(
        StoreError,
        match=rf"{path}.*schema version {STORE_SCHEMA_VERSION + 1}.*upgrade autobatch.*"
        "AUTOBATCH_STORE",
    ):
        ProfileStore(path)
    assert path.read_bytes() == before


def test_random_bytes_are_refused_and_left_unchanged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "garbage.sqlite3"
    before = os.urandom(4096)
    path.write_bytes(before)
    with pytest.raises(StoreError, match=rf"{path}.*not a database.*move it away") as e:
        ProfileStore(path)
    assert isinstance(e.value.__cause__, sqlite3.DatabaseError)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.sqlite3"]


def test_foreign_sqlite_database_is_refused_and_left_unchanged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "foreign.sqlite3"
    with _raw(path) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
        conn.execute("INSERT INTO users VALUES ('ada')")
    before = path.read_bytes()
    with pytest.raises(
        StoreError, match=rf"{path} is a SQLite database but not an autobatch.*users.*move it away"
    ):
        ProfileStore(path)
    assert path.read_bytes() == before


def test_damaged_store_layout_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "damaged.sqlite3"
    with ProfileStore(path):
        pass
    with _raw(path) as conn:
        conn.execute("DROP TABLE profiles")
    with pytest.raises(StoreError, match=rf"{path} is damaged.*move it away"):
        ProfileStore(path)


def test_newer_profile_schema_raises_on_get_and_is_skipped_by_find(
    store: ProfileStore,
) -> None:
    current = make_profile()
    current_id = store.put(current)
    newer_id = store.put(make_profile(schema_version=PROFILE_SCHEMA_VERSION + 1))
    with pytest.raises(
        StoreError, match=rf"cannot read profile '{newer_id}'.*newer.*upgrade autobatch"
    ) as e:
        store.get(newer_id)
    assert isinstance(e.value.__cause__, ConfigError)
    assert not isinstance(e.value, ProfileNotFoundError)
    assert store.find(current.cache_key()) == (current_id, current)
    assert store.list_profiles() == [(current_id, current)]


def test_unwritable_location_raises_store_error(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot create the directory.*AUTOBATCH_STORE"):
        ProfileStore(blocker / "store.sqlite3")
    with pytest.raises(StoreError, match=rf"{tmp_path}.*unable to open.*permissions"):
        ProfileStore(tmp_path)  # a directory, not a file


# -- readiness probe ----------------------------------------------------------------------------


def test_check_writable_writes_nothing(sqlite_store: ProfileStore) -> None:
    profile_id = sqlite_store.put(make_profile())
    sqlite_store.check_writable()
    assert [pid for pid, _ in sqlite_store.list_profiles()] == [profile_id]
    with _raw(sqlite_store.path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (STORE_SCHEMA_VERSION,)
    sqlite_store.put(make_profile())  # the write lock was released


def test_check_writable_raises_while_another_process_holds_the_lock(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "locked.sqlite3"
    with ProfileStore(path, timeout_seconds=0.05) as store, _raw(path) as holder:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match=rf"{path}.*locked.*write lock"):
            store.check_writable()
        with pytest.raises(StoreError, match="locked"):
            store.put(make_profile())
        assert store.list_profiles() == []  # readers are not blocked under WAL
        holder.execute("ROLLBACK")
        store.check_writable()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores modes")
def test_check_writable_raises_on_read_only_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ro.sqlite3"
    with ProfileStore(path) as store:
        store.put(make_profile())
    path.chmod(0o444)
    try:
        with ProfileStore(path) as store, pytest.raises(StoreError, match="readonly"):
            store.check_writable()
    finally:
        path.chmod(0o644)


# -- concurrency --------------------------------------------------------------------------------


def test_threads_share_one_store(store: ProfileStore) -> None:
    num_threads, num_each = 8, 25
    ids: list[str] = []
    ids_lock = threading.Lock()

    def work(index: int) -> None:
        for n in range(num_each):
            profile_id = store.put(make_profile(model_fingerprint=f"t{index}-{n}"))
            assert store.get(profile_id).model_fingerprint == f"t{index}-{n}"
            with ids_lock:
                ids.append(profile_id)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    listed = store.list_profiles(limit=1000)
    assert len(listed) == num_threads * num_each
    assert sorted(pid for pid, _ in listed) == sorted(ids)


def _put_many(path: str, worker: int, count: int) -> list[str]:
    """Runs in a spawned process: open the (possibly not yet created) store and write."""
    with ProfileStore(path) as store:
        ids = []
        for n in range(count):
            ids.append(store.put(make_profile(model_fingerprint=f"w{worker}", num_steps=n + 1)))
            store.list_profiles(limit=5)
        return ids


@pytest.mark.slow
def test_concurrent_processes_write_to_one_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "shared" / "profiles.sqlite3"  # created by whichever worker gets there first
    num_workers, num_each = 4, 30
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=context) as pool:
        futures = [pool.submit(_put_many, str(path), w, num_each) for w in range(num_workers)]
        results = [future.result(timeout=120) for future in futures]
    with ProfileStore(path) as store:
        listed = store.list_profiles(limit=1000)
        for worker, ids in enumerate(results):
            mine = store.list_profiles(model_fingerprint=f"w{worker}", limit=1000)
            # each worker's own writes come back newest first, in the order it made them
            assert [pid for pid, _ in mine] == ids[::-1]
            assert [p.num_steps for _, p in mine] == list(range(num_each, 0, -1))
    assert len(listed) == num_workers * num_each
    assert len({pid for pid, _ in listed}) == num_workers * num_each


_open_barrier: Any = None


def _set_open_barrier(barrier: Any) -> None:
    global _open_barrier
    _open_barrier = barrier


def _open_new_store_at_once(path: str) -> str:
    """Runs in a pool worker: wait for every worker, then open (and so create) the store."""
    _open_barrier.wait(timeout=60)
    try:
        with ProfileStore(path) as store:
            store.put(make_profile(model_fingerprint=str(os.getpid())))
    except StoreError as exc:
        return str(exc)
    return ""


@pytest.mark.slow
def test_processes_opening_a_new_file_at_once_all_succeed(tmp_path: pathlib.Path) -> None:
    # Each round is a new file opened by 8 processes released together by a barrier. Before the
    # open check was one read transaction, a process saw the file half-created and called it
    # "not an autobatch profile store" (about 1 round in 20); before the WAL switch was retried,
    # one got "database is locked" at once (about 1 round in 15).
    num_workers, num_rounds = 8, 100
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_workers)
    with context.Pool(num_workers, _set_open_barrier, (barrier,)) as pool:
        for round_index in range(num_rounds):
            path = str(tmp_path / f"round{round_index}.sqlite3")
            errors = pool.map(_open_new_store_at_once, [path] * num_workers, chunksize=1)
            assert errors == [""] * num_workers, f"round {round_index}: {errors}"
            with ProfileStore(path) as store:
                assert len(store.list_profiles(limit=100)) == num_workers


@pytest.mark.parametrize(
    ("recorded", "stop_kind"),
    [
        ({"stop_reason": "limit max_micro_batch_size=64 reached"}, "limit"),
        ({"stop_reason": "micro-batch 41 does not fit"}, "boundary"),
        (
            {"stop_reason": "micro-batch 8 failed (RuntimeError)", "failed_micro_batch_size": 8},
            "failure",
        ),
    ],
)
def test_a_schema_1_profile_in_the_store_is_read_with_its_stop_kind(
    sqlite_store: ProfileStore, recorded: dict[str, Any], stop_kind: str
) -> None:
    """Profiles stored before stop_kind existed (schema 1) still answer, with the kind derived."""
    data = make_profile().to_dict()
    del data["stop_kind"]
    data.update(recorded, schema_version=1)
    with sqlite3.connect(sqlite_store.path) as conn:  # as autobatch 0.1 wrote it
        conn.execute(
            "INSERT INTO profiles (id, cache_key, model_fingerprint, device_name, created_at,"
            " profile_schema_version, profile_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                "old",
                make_profile().cache_key(),
                "model-a",
                "sim",
                "2026-01-01",
                1,
                json.dumps(data),
            ),
        )
    loaded = sqlite_store.get("old")
    assert loaded.stop_kind == stop_kind
    assert loaded.stop_reason == recorded["stop_reason"]
    assert loaded.schema_version == PROFILE_SCHEMA_VERSION
    assert sqlite_store.find(make_profile().cache_key()) == ("old", loaded)


def test_stop_kind_must_agree_with_a_failed_size() -> None:
    with pytest.raises(ConfigError, match="stop_kind 'boundary' disagrees"):
        make_profile(failed_micro_batch_size=8)
    assert make_profile(stop_kind="failure", failed_micro_batch_size=8).failed_micro_batch_size == 8


def test_identity_is_stored_flat_as_before() -> None:
    data = make_profile().to_dict()
    assert "identity" not in data
    assert data["model_fingerprint"] == "model-a"
    assert data["input_shape"] == {"input_ids": [512], "labels": [512]}
    assert Profile.from_dict(data) == make_profile()


def test_a_profile_stored_with_the_data_parallel_size_under_its_old_key_still_loads(
    sqlite_store: ProfileStore,
) -> None:
    """Conditions stored as ``data_parallel_size``/``data_parallel_source`` load as
    ``world_size``/``world_size_source``; a profile is written under the new keys."""
    conditions = Conditions(device_type="sim", world_size=4, world_size_source="torchrun")
    profile = make_profile(conditions=conditions)
    data = profile.to_dict()
    assert data["conditions"]["world_size"] == 4
    assert "data_parallel_size" not in data["conditions"]
    stored = dict(data["conditions"])
    stored["data_parallel_size"] = stored.pop("world_size")
    stored["data_parallel_source"] = stored.pop("world_size_source")
    data["conditions"] = stored
    with sqlite3.connect(sqlite_store.path) as conn:  # the conditions under the alias's keys
        conn.execute(
            "INSERT INTO profiles (id, cache_key, model_fingerprint, device_name, created_at,"
            " profile_schema_version, profile_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                "old",
                profile.cache_key(),
                "model-a",
                "sim",
                "2026-01-01",
                PROFILE_SCHEMA_VERSION,
                json.dumps(data),
            ),
        )
    loaded = sqlite_store.get("old")
    assert loaded.conditions.world_size == 4
    assert loaded.conditions.world_size_source == "torchrun"
    assert loaded == profile
