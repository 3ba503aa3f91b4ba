"""Concurrent publishers on one profile store, SQLite file beside PostgreSQL, in one run.

N processes (the nodes) each store M distinct profiles, every tenth one twice (a retry, which
must be a no-op), into one store; then the store is counted. Prints, per backend: profiles
lost, duplicates, wall time and per-put p50/p99.

    .venv/bin/python bench/store_publish.py                    # 8 x 200 on both backends
    .venv/bin/python bench/store_publish.py --publishers 4 --each 50 \\
        --postgres postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autobatch.store import ProfileStore  # noqa: E402
from tests.store.test_store import make_profile  # noqa: E402


def _publish(location: str, publisher: int, count: int) -> tuple[list[str], list[float]]:
    ids, seconds = [], []
    with ProfileStore(location) as store:
        for n in range(count):
            profile = make_profile(node_name=f"node-{publisher}", num_steps=n + 1)
            started = time.perf_counter()
            ids.append(store.put(profile))
            seconds.append(time.perf_counter() - started)
            if n % 10 == 0:
                assert store.put(profile) == ids[-1]
    return ids, seconds


def run(location: str, num_publishers: int, num_each: int) -> dict[str, Any]:
    with ProfileStore(location):
        pass  # created (or migrated) once, before the clock starts
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(num_publishers, mp_context=context) as pool:
        pool.submit(len, "").result()  # workers started
        started = time.perf_counter()
        futures = [pool.submit(_publish, location, p, num_each) for p in range(num_publishers)]
        results = [future.result() for future in futures]
        wall = time.perf_counter() - started
    published = [pid for ids, _ in results for pid in ids]
    seconds = sorted(s for _, times in results for s in times)
    with ProfileStore(location) as store:
        stored: list[str] = []
        before = None
        while True:
            page = store.list_summaries(limit=1000, before=before)
            stored += [s.id for s in page.summaries]
            if (before := page.next_before) is None:
                break
    return {
        "lost": len(set(published) - set(stored)),
        "duplicates": len(stored) - len(set(stored)),
        "stored": len(stored),
        "wall_s": wall,
        "p50_ms": statistics.median(seconds) * 1000,
        "p99_ms": seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishers", type=int, default=8)
    parser.add_argument("--each", type=int, default=200)
    parser.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a server's maintenance database: a throwaway database is created and dropped",
    )
    args = parser.parse_args()
    import psycopg

    name = f"autobatch_bench_{secrets.token_hex(6)}"
    with (
        psycopg.connect(args.postgres, autocommit=True) as admin,
        tempfile.TemporaryDirectory() as tmp,
    ):
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            locations = {
                "sqlite": str(Path(tmp) / "profiles.sqlite3"),
                "postgresql": args.postgres.rpartition("/")[0] + "/" + name,
            }
            print(f"{args.publishers} publishers x {args.each} profiles (every 10th put twice)")
            for backend, location in locations.items():
                r = run(location, args.publishers, args.each)
                print(
                    f"{backend:10s} stored {r['stored']}  lost {r['lost']}  duplicates "
                    f"{r['duplicates']}  wall {r['wall_s']:.2f} s  put p50 {r['p50_ms']:.1f} ms"
                    f"  p99 {r['p99_ms']:.1f} ms"
                )
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
