"""``GET /v1/profiles`` over many large profiles: pages of bounded size and memory."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.profiles.routes import PAGE_BYTES
from tests.store.test_store import make_profile

NUM_PROFILES = 300
NOTE_BYTES = 400_000  # about 0.4 MB of JSON per profile, 120 MB in all
PEAK_BYTES = 32 << 20  # a few pages' worth of decoded profiles and their JSON: not the store's


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
    assert peak_bytes < PEAK_BYTES  # a page's worth, not the store's 114 MiB
    seen = [entry["id"] for entry in page["profiles"]]
    while page["next_before"] is not None:
        page = client.get(
            "/v1/profiles", params={"limit": 1000, "before": page["next_before"]}
        ).json()
        seen += [entry["id"] for entry in page["profiles"]]
    assert len(seen) == len(set(seen)) == NUM_PROFILES
    # Summaries: the whole store in one page of a few hundred bytes per profile, no JSON decoded.
    tracemalloc.start()
    try:
        summaries = client.get("/v1/profile-summaries", params={"limit": 1000})
        _, summary_peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summaries.status_code == 200
    rows = summaries.json()["summaries"]
    assert [row["id"] for row in rows] == seen
    assert summaries.json()["next_before"] is None
    assert len(summaries.content) < 1000 * NUM_PROFILES
    assert summary_peak_bytes < 2 << 20
    print(
        f"summaries: {len(rows)} in {len(summaries.content) / 2**10:.0f} KiB, traced peak "
        f"{summary_peak_bytes / 2**20:.1f} MiB"
    )


def test_summaries_page_and_filter_and_match_the_profiles(client: TestClient) -> None:
    ids = [
        client.post(
            "/v1/profiles",
            json=make_profile(num_steps=n + 1, node_name=f"node-{n % 2}").to_dict(),
        ).json()["id"]
        for n in range(5)
    ]
    first = client.get("/v1/profile-summaries", params={"limit": 3}).json()
    assert [row["id"] for row in first["summaries"]] == ids[::-1][:3]
    rest = client.get(
        "/v1/profile-summaries", params={"limit": 3, "before": first["next_before"]}
    ).json()
    assert [row["id"] for row in rest["summaries"]] == ids[::-1][3:]
    assert rest["next_before"] is None
    node_1 = client.get("/v1/profile-summaries", params={"node_name": "node-1"}).json()
    assert [row["id"] for row in node_1["summaries"]] == [ids[3], ids[1]]
    whole = client.get(f"/v1/profiles/{ids[0]}").json()["profile"]
    row = rest["summaries"][-1]
    for name in ("model_fingerprint", "device_name", "node_name", "max_micro_batch_size"):
        assert row[name] == whole[name]
    # The key is an object, not JSON text inside JSON, and names the card it was measured on.
    assert isinstance(row["cache_key"], dict)
    assert row["cache_key"]["device"] == whole["device_name"]
    assert row["cache_key"]["model"] == whole["model_fingerprint"]
    assert set(row) == {
        "id", "cache_key", "model_fingerprint", "device_name", "node_name", "model_name",
        "max_micro_batch_size", "recommended_micro_batch_size", "created_at",
    }  # fmt: skip
    unknown = client.get("/v1/profile-summaries", params={"before": "ffffffffffffffff"})
    assert unknown.status_code == 404
