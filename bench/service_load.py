"""Load on loopback: ``POST /v1/plan`` beside two empty routes, served the same way.

The baselines, both ``POST`` routes that read nothing and answer ``{"ok": true}``:

- ``empty (service)``: an empty route in the service's own app (``create_app``: the same
  ``ServiceMiddleware``, problem handlers and routing table, served by the same uvicorn process
  as the plan route, with the same ``uvicorn.run`` arguments as ``autobatch serve``), added to
  the plan route's own ``APIRouter`` right after it (``POST /v1/plan/bench-empty``): the same
  included-router dispatch, prefix and route class, where an empty route added to the app
  itself would skip FastAPI's dispatch through an included router (about 10 µs per request
  in-process on 2 cores), and one in a router of its own would cost the plan route a router
  mismatch (about 3 µs) it never pays in ``autobatch serve``. The empty route pays one path
  mismatch (the plan route's) on the way, about 1 µs. Plan over this is the plan route's own
  cost: reading and validating the body, planning, the framework configs, the JSON answer.
- ``empty (bare)``: a bare FastAPI app with one route and no middleware, in its own process:
  the floor of FastAPI and uvicorn. Plan over this adds the service's middleware (bearer token,
  body size, request metrics), which every route of the service pays.

The load generator is a minimal asyncio HTTP/1.1 keep-alive client (one connection per
concurrent caller), so the client costs the same for all three. For each concurrency level it
sends a fixed number of requests to each, in interleaved rounds (plan, empty, bare, plan, ...)
so that a shift in the machine's speed during the run hits all alike, and prints requests/s,
p50/p99 latency and the server process's CPU time per request (from /proc; on a 2-core machine
shared with the client, the steadiest of the three), then the ratios measured side by side in
this one run, with the p99 ratio of each round beside its neighbour (median and range) to show
how much of a pooled p99 is one stall of the shared machine.

Goals, per concurrency level: the plan route's p99 latency within 1.5x of the empty
route's, and its server CPU time per request within 2x; checked against each baseline. An
absolute p99 target is not used: on a shared 2-core machine the empty route alone varies from
run to run (17-24 ms at concurrency 32).

Central mode: two more rows plan from the store, as a fleet's service does. The
store (in memory, in the service's process) holds :data:`FLEET_NODES` nodes' profiles of one
model on each of three cards, the asked card's oldest and its newest under other conditions,
and other models' profiles beside them. ``plan (node)`` is the per-node route (``POST /v1/plan``
with ``model_fingerprint`` alone: since issue 43 drawn among the nodes too, on the card the
most nodes measured, one profile per node, what a node's sidecar answers); ``plan (node=)``
names its node (``node``: that node's own latest profile answers);
``plan (card)`` plans for a card type under conditions (``card`` and ``conditions``: drawn among
each node's latest profile of the model measured on that card under them, no node alone
deciding). Goal: the card route's p99 within 2x of the per-node route's
(:data:`CARD_P99_GOAL`), in the same run.

    .venv/bin/python bench/service_load.py                       # 15000 requests per level
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
CARD_P99_GOAL = 2.0
"""Card-type plan route's p99 latency over the per-node plan route's, at the same concurrency."""
PLAN_BODY = json.dumps(
    {"max_micro_batch_size": 24, "effective_batch_size": 1024, "world_size": 8}
).encode()
FINGERPRINT = "bench-gpt"
CARDS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4")
FLEET_NODES = 16
"""Nodes per card that published a profile of the benchmark's model."""
NODE_BODY = json.dumps(
    {"model_fingerprint": FINGERPRINT, "effective_batch_size": 1024, "world_size": 8}
).encode()
NAMED_NODE_BODY = json.dumps(
    {
        "model_fingerprint": FINGERPRINT,
        "node": "h100-node-0",
        "effective_batch_size": 1024,
        "world_size": 8,
    }
).encode()
CARD_BODY = json.dumps(
    {
        "model_fingerprint": FINGERPRINT,
        "card": CARDS[0],
        "conditions": {"amp_dtype": "bfloat16"},
        "effective_batch_size": 1024,
        "world_size": 8,
    }
).encode()


def fleet_profiles() -> list[Any]:
    """Profiles as a fleet publishes them, oldest first: the asked card's first, its newest
    under other conditions (fp16), then the other cards', then other models'."""
    from autobatch.conditions import Conditions
    from autobatch.profile import MemoryModel, Profile, StepIdentity, Trial

    gib = 2**30
    trials = tuple(
        Trial(micro_batch_size=n, fits=True, peak_reserved_bytes=4 * gib + n * gib // 2)
        for n in (1, 8, 16, 32, 64)
    ) + (Trial(micro_batch_size=128, fits=False, oom=True, error="OutOfMemoryError"),)
    profiles = []
    for card in CARDS:
        for node in range(FLEET_NODES):
            amp = "float16" if card == CARDS[0] and node == FLEET_NODES - 1 else "bfloat16"
            for model in (FINGERPRINT, f"other-{node}"):
                profiles.append(
                    Profile(
                        max_micro_batch_size=64,
                        recommended_micro_batch_size=60,
                        safety_margin=0.05,
                        method="probe",
                        trials=trials,
                        num_steps=len(trials) + 1,
                        device_name=card,
                        device_type="cuda",
                        total_memory_bytes=80 * gib,
                        capacity_bytes=80 * gib,
                        memory_model=MemoryModel(fixed_bytes=4 * gib, bytes_per_sample=gib // 2),
                        node_name=f"{card.split()[1].lower()}-node-{node}",
                        conditions=Conditions(device_type="cuda", amp_dtype=amp),
                        identity=StepIdentity(model_fingerprint=model),
                    )
                )
    return profiles


async def empty() -> dict[str, bool]:
    return {"ok": True}


def bare_app() -> Any:
    """A FastAPI app with one empty route and nothing else."""
    from fastapi import FastAPI

    app = FastAPI()
    app.post("/bench/empty")(empty)
    return app


def service_app() -> Any:
    """The service's app (in-memory store) with an empty route right after ``POST /v1/plan``,
    in its router (``POST /v1/plan/bench-empty``)."""
    from service.main import create_app
    from service.plans import routes as plans
    from service.web.settings import Settings

    app = create_app(Settings(store_path=":memory:"))
    for profile in fleet_profiles():
        app.state.service.store.put(profile)
    # The app dispatches to its included routers' routes as they are when a request comes.
    plans.router.post("/bench-empty")(empty)
    return app


def serve(app: Any, port: int) -> None:
    """Serve ``app`` as ``service.main.run`` serves the service."""
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(command: list[str], port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
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
    round_p99s: list[float] = dataclasses.field(default_factory=list)
    """Each round's own p99 (seconds), for ratios paired round by round."""
    seconds: float = 0.0
    server_cpu_seconds: float = 0.0

    def run(
        self,
        server: subprocess.Popen[bytes],
        port: int,
        endpoint: tuple[str, int, str, bytes],
        requests: int,
        concurrency: int,
    ) -> None:
        _, _, path, body = endpoint
        cpu, started = cpu_seconds(server.pid), time.perf_counter()
        latencies = asyncio.run(load(port, path, body, requests, concurrency))
        self.seconds += time.perf_counter() - started
        self.server_cpu_seconds += cpu_seconds(server.pid) - cpu
        self.latencies += latencies
        self.round_p99s.append(p99(latencies))

    def summary(self) -> dict[str, float]:
        return {
            "rps": len(self.latencies) / self.seconds,
            "p50_ms": 1000 * statistics.median(self.latencies),
            "p99_ms": 1000 * p99(self.latencies),
            "cpu_us": 1e6 * self.server_cpu_seconds / len(self.latencies),
        }


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


ENDPOINTS = (
    ("POST /v1/plan", 0, "/v1/plan", PLAN_BODY),
    ("empty (service)", 0, "/v1/plan/bench-empty", PLAN_BODY),
    ("empty (bare)", 1, "/bench/empty", PLAN_BODY),
    ("plan (node)", 0, "/v1/plan", NODE_BODY),
    ("plan (card)", 0, "/v1/plan", CARD_BODY),
    ("plan (node=)", 0, "/v1/plan", NAMED_NODE_BODY),
)
"""(name, index of its server, path, body): the plan route, the two baselines, the per-node
plan (model alone, what a sidecar asks), the card-type plan, and a plan naming its node."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A p99 of a few thousand requests moves with one stall of a shared machine (at concurrency
    # 32 one stall delays 32 requests at once). 15000 in 10 rounds take about 27 s in all on 2
    # cores; three such runs on a busy machine gave pooled p99 ratios of 1.07x to 1.55x.
    parser.add_argument("--requests", type=int, default=15000, help="per endpoint and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per level")
    parser.add_argument("--serve", nargs=2, metavar=("APP", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve({"service": service_app, "bare": bare_app}[args.serve[0]](), int(args.serve[1]))
        return 0
    ports = [free_port(), free_port()]
    servers = [
        start([sys.executable, __file__, "--serve", name, str(port)], port)
        for name, port in zip(("service", "bare"), ports, strict=True)
    ]
    try:
        for _, server, path, body in ENDPOINTS:  # warm up (imports, first-call caches)
            asyncio.run(load(ports[server], path, body, 200, 4))
        print(
            f"{os.cpu_count()} CPUs, {args.requests} requests per endpoint and level, "
            f"in {args.rounds} interleaved rounds"
        )
        print(
            f"{'conc':>4} {'endpoint':>15} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'server CPU us/req':>18}"
        )
        per_round = max(1, args.requests // args.rounds)
        for concurrency in args.concurrency:
            tallies = [Tally() for _ in ENDPOINTS]
            for _ in range(args.rounds):
                for tally, endpoint in zip(tallies, ENDPOINTS, strict=True):
                    server = endpoint[1]
                    tally.run(servers[server], ports[server], endpoint, per_round, concurrency)
            report_level(concurrency, tallies)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    return 0


def report_level(concurrency: int, tallies: list[Tally]) -> None:
    """One concurrency level's rows (each endpoint), then plan's ratios to the baselines and
    the card plan's to the node plan, each against its goal."""
    results = [tally.summary() for tally in tallies]
    for (name, *_), result in zip(ENDPOINTS, results, strict=True):
        print(
            f"{concurrency:>4} {name:>15} {result['rps']:>8.0f} "
            f"{result['p50_ms']:>8.2f} {result['p99_ms']:>8.2f} {result['cpu_us']:>18.0f}"
        )
    plan = results[0]
    for (name, *_), empty_result, empty_tally in zip(
        ENDPOINTS[1:3], results[1:3], tallies[1:3], strict=True
    ):
        p99_ratio = plan["p99_ms"] / empty_result["p99_ms"]
        cpu = empty_result["cpu_us"]
        cpu_ratio = plan["cpu_us"] / cpu if cpu else float("nan")
        print(
            f"{'':>4} plan/{name}: p99 {p99_ratio:.2f}x "
            f"({'met' if p99_ratio <= P99_GOAL else 'MISSED'}: <= {P99_GOAL}x), "
            f"server CPU per request {cpu_ratio:.2f}x "
            f"({'met' if cpu_ratio <= CPU_GOAL else 'MISSED'}: <= {CPU_GOAL}x)"
        )
        # At high concurrency one stall of the shared machine delays every request in
        # flight at once, so a pooled p99 can be one event: the rounds' own ratios,
        # each plan round beside the baseline round run right after it, show the spread.
        paired = sorted(
            a / b for a, b in zip(tallies[0].round_p99s, empty_tally.round_p99s, strict=True)
        )
        print(
            f"{'':>4} {'':>{len(name) + 6}} p99 ratio round by round: median "
            f"{statistics.median(paired):.2f}x, {paired[0]:.2f}x to {paired[-1]:.2f}x "
            f"over {len(paired)} rounds"
        )
    card = results[4]
    for index, name in ((3, "plan (node)"), (5, "plan (node=)")):
        node = results[index]
        card_ratio = card["p99_ms"] / node["p99_ms"]
        cpu_ratio = card["cpu_us"] / node["cpu_us"] if node["cpu_us"] else float("nan")
        paired = sorted(
            a / b for a, b in zip(tallies[4].round_p99s, tallies[index].round_p99s, strict=True)
        )
        print(
            f"{'':>4} plan (card)/{name}: p99 {card['p99_ms']:.2f} ms / "
            f"{node['p99_ms']:.2f} ms = {card_ratio:.2f}x "
            f"({'met' if card_ratio <= CARD_P99_GOAL else 'MISSED'}: <= {CARD_P99_GOAL}x), "
            f"server CPU per request {cpu_ratio:.2f}x; round by round: median "
            f"{statistics.median(paired):.2f}x, {paired[0]:.2f}x to {paired[-1]:.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
