"""``GET /v1/profiles`` over many large profiles: pages of bounded size and memory."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.routes.profiles import PAGE_BYTES
from tests.profiles.test_store import make_profile

NUM_PROFILES = 300
NOTE_BYTES = 400_000  # about 0.4 MB of JSON per profile, 120 MB in all


@pytest.mark.slow
def test_a_listing_of_300_large_profiles_is_paged_with_bounded_memory(
    make_app: Callable[..., Any],
) -> None:
    app: FastAPI = make_app()
    store = app.state.service.store
    for n in range(NUM_PROFILES):
        notes = tuple(f"{n}.{i}" + "x" * 4000 for i in range(NOTE_BYTES // 4000))
        store.put(make_profile(num_steps=n + 1, notes=notes))
    client = TestClient(app)
    tracemalloc.start()
    try:
        first = client.get("/v1/profiles", params={"limit": 1000})
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first.status_code == 200
    page = first.json()
    num_first = len(page["profiles"])
    print(
        f"\nfirst page: {num_first} profiles, {len(first.content) / 2**20:.1f} MiB, "
        f"traced peak {peak_bytes / 2**20:.1f} MiB (store holds "
        f"{NUM_PROFILES * NOTE_BYTES / 2**20:.0f} MiB)"
    )
    assert 1 <= num_first < NUM_PROFILES and page["next_before"] is not None
    assert len(first.content) <= PAGE_BYTES + 2 * NOTE_BYTES
    assert peak_bytes < 4 * PAGE_BYTES  # a page's worth, not the store's 114 MiB
    seen = [entry["id"] for entry in page["profiles"]]
    while page["next_before"] is not None:
        page = client.get(
            "/v1/profiles", params={"limit": 1000, "before": page["next_before"]}
        ).json()
        seen += [entry["id"] for entry in page["profiles"]]
    assert len(seen) == len(set(seen)) == NUM_PROFILES
