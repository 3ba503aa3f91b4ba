"""Load on loopback: ``POST /v1/plan`` beside a trivial FastAPI endpoint, served the same way.

Both run under uvicorn (one worker, log level warning) in their own process; the load generator
is a minimal asyncio HTTP/1.1 keep-alive client (one connection per concurrent caller), so the
client costs the same for both. For each concurrency level it sends a fixed number of requests
and prints requests/s and p50/p99 latency, and the plan/trivial throughput ratio.

Targets (issue 4): plan within 1.5x of the trivial endpoint's throughput, p99 under 20 ms at
concurrency 32, on a 2-core machine.

    .venv/bin/python bench/service_load.py                       # 3000 requests per level
    .venv/bin/python bench/service_load.py --requests 500 --concurrency 1 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN_BODY = json.dumps(
    {"max_micro_batch_size": 24, "effective_batch_size": 1024, "world_size": 8}
).encode()


def trivial_app() -> object:
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


async def load(
    port: int, path: str, body: bytes, requests: int, concurrency: int
) -> dict[str, float]:
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    latencies: list[float] = []
    per_caller = [
        requests // concurrency + (i < requests % concurrency) for i in range(concurrency)
    ]
    started = time.perf_counter()
    await asyncio.gather(*(caller(port, request, n, latencies) for n in per_caller))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="per endpoint and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
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
        print(f"{os.cpu_count()} CPUs, {args.requests} requests per endpoint and level")
        print(f"{'conc':>4} {'endpoint':>12} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
        for concurrency in args.concurrency:
            plan = asyncio.run(load(plan_port, "/v1/plan", PLAN_BODY, args.requests, concurrency))
            trivial = asyncio.run(
                load(trivial_port, "/trivial", PLAN_BODY, args.requests, concurrency)
            )
            for name, result in (("POST /v1/plan", plan), ("trivial", trivial)):
                print(
                    f"{concurrency:>4} {name:>12} {result['rps']:>9.0f} "
                    f"{result['p50_ms']:>8.2f} {result['p99_ms']:>8.2f}"
                )
            print(f"{'':>4} {'ratio':>12} {trivial['rps'] / plan['rps']:>9.2f}x (trivial/plan)")
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
