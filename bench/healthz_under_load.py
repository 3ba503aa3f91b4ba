"""``/healthz`` latency while 8 clients send the costliest requests the service accepts, beside
an idle baseline, in one run against a real ``autobatch serve`` on loopback.

The costly requests, each the largest of its kind that is not refused: a plan whose answer lists
the most micro-batch sizes an answer may (``service.plans.limits.MAX_ANSWER_MICRO_BATCHES``: a
plan and one table row of 2**17 steps each), and a profile as large as the body limit takes
(about 0.9 MiB of notes), stored and read back. The clients run in a child process of their
own (so that their work is not this process's, which times ``/healthz``), each on its own
keep-alive connection, back to back. ``/healthz`` is timed on a fresh connection over a bare
socket (connect, send, read to the close), first with the server idle, then under the load.

With ``--listings``, the costly request is instead the costliest a read token may send: ``GET
/v1/profiles?after=0&limit=1000`` over a store seeded with 1,000 profiles of about 6.3 KB each
(6.3 MB a page without a cap), by every client at once.

Prints p50 and p99 of each phase and their ratio, the costly requests answered by status, and
whether the loaded p99 is within the goal (``/healthz`` under 100 ms, the liveness
probe's timeout being 1 s).

Example::

    python bench/healthz_under_load.py --samples 200 --clients 8
    python bench/healthz_under_load.py --samples 200 --clients 8 --listings
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 0.100
LISTING = "/v1/profiles?after=0&limit=1000"
SEEDED_PROFILES = 1000
PLAN_AT_CAP = {"max_micro_batch_size": 1, "effective_batch_size": 2**17, "world_sizes": [1]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def healthz_seconds(port: int) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 "), received[:100]
    return time.perf_counter() - started


def large_profile() -> dict[str, object]:
    sys.path.insert(0, str(ROOT))
    from tests.store.test_store import make_profile

    return {**make_profile().to_dict(), "notes": ["n" * 4000] * 220}


def seed(store_path: Path) -> None:
    """Fill the store with ``SEEDED_PROFILES`` profiles of about 6.3 KB each."""
    sys.path.insert(0, str(ROOT))
    from autobatch.store import ProfileStore
    from tests.store.test_store import make_profile

    with ProfileStore(store_path) as store:
        for index in range(SEEDED_PROFILES):
            store.put(make_profile(num_steps=index + 1, notes=("n" * 2500, "n" * 2500)))


def load(port: int, clients: int, stop_file: Path, *, listings: bool = False) -> None:
    """The child: ``clients`` threads sending the costly requests until ``stop_file`` exists;
    prints the statuses as JSON."""
    import httpx

    profile = large_profile()
    statuses: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def client(index: int) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            turn = index
            while not stop_file.exists():
                if listings:
                    response = http.get(LISTING)
                    kind = "listing"
                elif turn % 2 == 0:
                    response = http.post("/v1/plan", json=PLAN_AT_CAP)
                    kind = "plan"
                else:
                    body = {**profile, "num_steps": turn}
                    response = http.post("/v1/profiles", json=body)
                    if response.status_code == 201:
                        http.get(response.headers["Location"])
                    kind = "profile"
                turn += 1
                with lock:
                    statuses[f"{kind} {response.status_code}"] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(statuses))


def phase(port: int, samples: int) -> list[float]:
    latencies = []
    for _ in range(samples):
        latencies.append(healthz_seconds(port))
        time.sleep(0.01)
    return latencies


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="/healthz calls per phase")
    parser.add_argument("--clients", type=int, default=8, help="concurrent costly clients")
    parser.add_argument(
        "--listings", action="store_true", help=f"the clients send GET {LISTING} instead"
    )
    parser.add_argument("--load", nargs=2, metavar=("PORT", "STOP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        load(int(args.load[0]), args.clients, Path(args.load[1]), listings=args.listings)
        return 0
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AUTOBATCH_API_TOKEN", None)
    with tempfile.TemporaryDirectory() as folder:
        store, stop = Path(folder) / "store.sqlite3", Path(folder) / "stop"
        if args.listings:
            seed(store)
        server = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", str(port), "--store-path", str(store)]
            + ["--log-level", "warning"],
            cwd=ROOT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    healthz_seconds(port)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the server did not start") from None
                    time.sleep(0.2)
            idle = phase(port, args.samples)
            loader = subprocess.Popen(
                [sys.executable, __file__, "--clients", str(args.clients)]
                + (["--listings"] if args.listings else [])
                + ["--load", str(port), str(stop)],
                env=env,
                stdout=subprocess.PIPE,
            )
            time.sleep(1.0)  # the clients under way
            loaded = phase(port, args.samples)
            stop.touch()
            out, _ = loader.communicate(timeout=120)
        finally:
            server.terminate()
            server.wait(timeout=30)
    statuses = json.loads(out.decode().strip().splitlines()[-1])
    print(f"{'phase':<8} {'samples':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, latencies in (("idle", idle), ("loaded", loaded)):
        median, tail = statistics.median(latencies) * 1e3, p99(latencies) * 1e3
        print(f"{name:<8} {len(latencies):>8} {median:>8.1f} {tail:>8.1f}")
    ratio_p50 = statistics.median(loaded) / statistics.median(idle)
    print(f"ratio loaded/idle: p50 {ratio_p50:.2f}x, p99 {p99(loaded) / p99(idle):.2f}x")
    print(
        "costly requests answered: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    )
    within = p99(loaded) < GOAL_S
    print(f"goal: loaded p99 under {GOAL_S * 1e3:.0f} ms: {'met' if within else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
