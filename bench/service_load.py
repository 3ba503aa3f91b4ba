"""Load on loopback: ``POST /v1/plan`` beside an empty FastAPI route, served the same way.

Both run under uvicorn (one worker, log level warning) in their own process; the load generator
is a minimal asyncio HTTP/1.1 keep-alive client (one connection per concurrent caller), so the
client costs the same for both. For each concurrency level it sends a fixed number of requests
to each, in interleaved rounds (plan, empty, plan, ...) so that a shift in the machine's speed
during the run hits both alike, and prints requests/s, p50/p99 latency and the server process's
CPU time per request (from /proc; on a 2-core machine shared with the client, the steadiest of
the three), then the ratios measured side by side in this one run.

Goals (issue 11), per concurrency level: the plan route's p99 latency within 1.5x of the empty
route's, and its server CPU time per request within 2x. An absolute p99 target is not used: on a
shared 2-core machine the empty route alone varies from run to run (17-24 ms at concurrency 32).

    .venv/bin/python bench/service_load.py                       # 3000 requests per level
    .venv/bin/python bench/service_load.py --requests 500 --rounds 2 --concurrency 1 32
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
P99_GOAL = 1.5
"""Plan route's p99 latency over the empty route's, at the same concurrency."""
CPU_GOAL = 2.0
"""Plan route's server CPU time per request over the empty route's."""
PLAN_BODY = json.dumps(
    {"max_micro_batch_size": 24, "effective_batch_size": 1024, "world_size": 8}
).encode()


def trivial_app() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/trivial")
    async def trivial() -> dict[str, bool]:
        return {"ok": True}

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(command: list[str], port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server {command} did not start")


async def caller(port: int, request: bytes, count: int, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(count):
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"status {status}: {head!r}")
    finally:
        writer.close()


async def load(port: int, path: str, body: bytes, requests: int, concurrency: int) -> list[float]:
    """Latencies in seconds of ``requests`` POSTs from ``concurrency`` keep-alive callers."""
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    latencies: list[float] = []
    per_caller = [
        requests // concurrency + (i < requests % concurrency) for i in range(concurrency)
    ]
    await asyncio.gather(*(caller(port, request, n, latencies) for n in per_caller if n))
    return latencies


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc, in clock ticks of usually 10 ms,
    so a level needs some hundreds of requests to read it well); 0.0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Tally:
    """One endpoint's requests at one concurrency level, summed over rounds."""

    latencies: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    server_cpu_seconds: float = 0.0

    def run(
        self, server: subprocess.Popen[bytes], port: int, path: str, requests: int, concurrency: int
    ) -> None:
        cpu, started = cpu_seconds(server.pid), time.perf_counter()
        self.latencies += asyncio.run(load(port, path, PLAN_BODY, requests, concurrency))
        self.seconds += time.perf_counter() - started
        self.server_cpu_seconds += cpu_seconds(server.pid) - cpu

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies)
        return {
            "rps": len(ordered) / self.seconds,
            "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "cpu_us": 1e6 * self.server_cpu_seconds / len(ordered),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="per endpoint and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per level")
    parser.add_argument("--serve-trivial", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_trivial is not None:
        import uvicorn

        uvicorn.run(trivial_app(), host="127.0.0.1", port=args.serve_trivial, log_level="warning")
        return 0
    plan_port, trivial_port = free_port(), free_port()
    servers = [
        start(
            [
                sys.executable,
                "-m",
                "service",
                "--host",
                "127.0.0.1",
                "--port",
                str(plan_port),
                "--store-path",
                ":memory:",
                "--log-level",
                "warning",
            ],
            plan_port,
        ),
        start([sys.executable, __file__, "--serve-trivial", str(trivial_port)], trivial_port),
    ]
    try:
        # Warm up both (imports, first-call caches).
        asyncio.run(load(plan_port, "/v1/plan", PLAN_BODY, 200, 4))
        asyncio.run(load(trivial_port, "/trivial", PLAN_BODY, 200, 4))
        print(
            f"{os.cpu_count()} CPUs, {args.requests} requests per endpoint and level, "
            f"in {args.rounds} interleaved rounds"
        )
        print(
            f"{'conc':>4} {'endpoint':>13} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'server CPU us/req':>18}"
        )
        per_round = max(1, args.requests // args.rounds)
        for concurrency in args.concurrency:
            plan, trivial = Tally(), Tally()
            for _ in range(args.rounds):
                plan.run(servers[0], plan_port, "/v1/plan", per_round, concurrency)
                trivial.run(servers[1], trivial_port, "/trivial", per_round, concurrency)
            p, t = plan.summary(), trivial.summary()
            for name, result in (("POST /v1/plan", p), ("trivial", t)):
                print(
                    f"{concurrency:>4} {name:>13} {result['rps']:>8.0f} "
                    f"{result['p50_ms']:>8.2f} {result['p99_ms']:>8.2f} {result['cpu_us']:>18.0f}"
                )
            cpu_ratio = p["cpu_us"] / t["cpu_us"] if t["cpu_us"] else float("nan")
            print(
                f"{'':>4} {'ratio':>13} {t['rps'] / p['rps']:>7.2f}x {'':>17} {cpu_ratio:>17.2f}x"
                "  (trivial/plan throughput; plan/trivial CPU)"
            )
            p99_ratio = p["p99_ms"] / t["p99_ms"]
            print(
                f"{'':>4} {'goals':>13} p99 plan/empty {p99_ratio:.2f}x "
                f"({'met' if p99_ratio <= P99_GOAL else 'MISSED'}: <= {P99_GOAL}x), "
                f"server CPU per request plan/empty {cpu_ratio:.2f}x "
                f"({'met' if cpu_ratio <= CPU_GOAL else 'MISSED'}: <= {CPU_GOAL}x)"
            )
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
