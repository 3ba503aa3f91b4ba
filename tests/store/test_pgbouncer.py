"""The PostgreSQL store behind a real PgBouncer in transaction mode (the usual pooler): it
opens, its timeouts hold (set per transaction, not as startup parameters the pooler refuses or
drops), prepared statements do not break on shared server connections, and a pooler that
refuses a startup parameter is named in the error. The lock timeout is checked on a direct
connection too."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from autobatch.errors import StoreError
from autobatch.store import ProfileStore
from tests.helpers.pgbouncer import pgbouncer, through
from tests.store.test_store import make_profile

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def bouncer_port() -> Iterator[int]:
    with pgbouncer() as port:
        yield port


@pytest.fixture(params=["direct", "pgbouncer"])
def store_url(request: pytest.FixtureRequest, postgres_url: str) -> str:
    if request.param == "direct":
        return postgres_url
    port: int = request.getfixturevalue("bouncer_port")
    return through(postgres_url, port)


@contextlib.contextmanager
def table_locked(url: str) -> Iterator[None]:
    """The profiles table locked by another client (directly on the server)."""
    import psycopg

    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("LOCK TABLE profiles IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")


def test_the_store_opens_and_works_through_the_pooler(store_url: str) -> None:
    with ProfileStore(store_url, timeout_seconds=TIMEOUT_S) as store:
        # More than psycopg's prepare threshold (5) of the same statements, on a pool of
        # connections the pooler hands to any server connection: server-side prepared
        # statements would fail here ("prepared statement ... does not exist").
        ids = [store.put(make_profile(num_steps=n + 1)) for n in range(12)]
        for profile_id in ids:
            assert store.get(profile_id).num_steps == ids.index(profile_id) + 1
        assert [pid for pid, _ in store.list_profiles(limit=100)] == ids[::-1]
        assert store.delete(ids[0]) is True


def test_a_put_under_a_held_lock_gives_up_at_the_timeout(store_url: str, postgres_url: str) -> None:
    with ProfileStore(store_url, timeout_seconds=TIMEOUT_S) as store:
        store.put(make_profile())  # the table exists
        with table_locked(postgres_url):
            started = time.perf_counter()
            # the database gave up itself (its lock or statement timeout, which fire together),
            # about at the store's timeout: not a client-side wait
            with pytest.raises(StoreError, match="(lock|statement) timeout"):
                store.put(make_profile(num_steps=7))
            seconds = time.perf_counter() - started
    assert seconds < TIMEOUT_S + 4, seconds


def test_a_startup_parameter_the_pooler_refuses_is_named(
    bouncer_port: int, postgres_url: str
) -> None:
    url = through(postgres_url, bouncer_port) + "?options=-c%20search_path%3Dpublic"
    with pytest.raises(StoreError) as raised:
        ProfileStore(url, timeout_seconds=TIMEOUT_S)
    message = str(raised.value)
    assert "unsupported startup parameter" in message
    assert "connection pooler in front of the database (PgBouncer)" in message
    assert "refused the startup parameter 'options'" in message
    assert "ignore_startup_parameters" in message
    assert "check that the PostgreSQL server is up" not in message


def test_a_resent_profile_is_stored_once_through_the_pooler(store_url: str) -> None:
    """``publish`` finds the stored profile a resend repeats, and the readiness check reads
    the profiles table, on shared server connections as directly."""
    profile = make_profile(num_steps=3, created_at="")
    with ProfileStore(store_url, timeout_seconds=TIMEOUT_S) as store:
        first_id, first, new = store.publish(profile)
        assert new and first.created_at
        assert store.publish(profile) == (first_id, first, False)
        assert len(store.list_profiles(limit=100)) == 1
        store.check_writable()


def test_the_readiness_check_fails_while_the_table_is_locked(
    store_url: str, postgres_url: str
) -> None:
    with ProfileStore(store_url, timeout_seconds=TIMEOUT_S) as store:
        store.check_writable()
        with table_locked(postgres_url), pytest.raises(StoreError):
            store.check_writable()
        store.check_writable()
