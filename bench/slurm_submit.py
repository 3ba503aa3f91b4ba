"""What autobatch's Slurm plugins add to a submission: ``sbatch --hold`` timed on a real one-node
Slurm without the plugins beside one with them (deploy/slurm/job_submit.lua and cli_filter.lua),
asking a real ``autobatch serve`` that holds a measured profile, in one run.

Printed, each as p50 / p99 over ``--jobs`` submissions (milliseconds of wall time, sbatch's whole
run: its start, munge, the controller's RPC):

- ``no plugins``: the bare cluster;
- ``plugins, no model``: a job naming no model (the plugins read it and leave it);
- ``plugins, cold``: each job a new effective batch, so the controller asks the service
  (and so does cli_filter in sbatch);
- ``plugins, warm``: the same batch each time, answered from the controller's cache (cli_filter,
  one process per sbatch, still asks: its advice is never cached);
- ``job_submit only, cold`` and ``warm``: the same with ``advice = off`` (the controller's
  decision alone, as a site that turns cli_filter's advice off sees it);
- ``the decision alone``: ``POST /v1/admissions`` from this process over a kept connection,
  cold (new batches) and warm (the service holds no cache: the same work).

The ratios to ``no plugins`` are printed beside. Needs root, slurm-wlm, munge, lua-socket and
lua-cjson (tests/helpers/slurm.py).

Usage::

    .venv/bin/python bench/slurm_submit.py [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autobatch.client import publish_profile  # noqa: E402
from autobatch.conditions import Conditions  # noqa: E402
from tests.helpers.slurm import Cluster, one_node_cluster, unavailable_reason  # noqa: E402
from tests.service.serving import serving  # noqa: E402
from tests.service.test_service_api import make_profile  # noqa: E402

FINGERPRINT = "9c1e5b0f7a3d2e48"
CARD = "NVIDIA H100 80GB HBM3"


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds (p99 by the inclusive method over the samples)."""
    ordered = sorted(seconds)
    p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def timed(call: Callable[[int], None], jobs: int) -> list[float]:
    found = []
    for index in range(jobs):
        started = time.perf_counter()
        call(index)
        found.append(time.perf_counter() - started)
    return found


def submitter(
    cluster: Cluster, variables: Callable[[int], dict[str, str]] | None = None
) -> Callable[[int], None]:
    """One ``sbatch --hold`` of a job with ``variables(index)`` in its environment (the held
    jobs are cancelled after each row, untimed)."""

    def submit(index: int) -> None:
        env = {**cluster.env, **(variables(index) if variables else {})}
        done = subprocess.run(
            ["sbatch", "--hold", "--gres=gpu:8", "--wrap", "true"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"sbatch failed: {done.stderr}")
        jobs_held.append((cluster, done.stdout.split()[-1]))

    return submit


def model(batch: int) -> dict[str, str]:
    return {
        "AUTOBATCH_MODEL_FINGERPRINT": FINGERPRINT,
        "AUTOBATCH_EFFECTIVE_BATCH_SIZE": str(batch),
    }


jobs_held: list[tuple[Cluster, str]] = []


def release() -> None:
    for cluster, job in jobs_held:
        subprocess.run(["scancel", job], env=cluster.env, check=False)
    jobs_held.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40, help="submissions per row")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="autobatch-bench-slurm-"))
    prolog = root / "taskprolog.sh"
    prolog.write_text("#!/bin/sh\nexit 0\n")
    prolog.chmod(0o755)
    config = root / "autobatch.conf"
    with ExitStack() as stack:
        server = stack.enter_context(serving(root))
        url = f"http://127.0.0.1:{server.port}"
        config.write_text(f"central_url = {url}\ncard = {CARD}\nretry_after_s = 0\n")
        bare = stack.enter_context(one_node_cluster(root / "bare", task_prolog=prolog))
        with_plugins = stack.enter_context(
            one_node_cluster(root / "plugins", task_prolog=prolog, submit_config=config)
        )
        profile = make_profile(
            model_fingerprint=FINGERPRINT,
            device_name=CARD,
            node_name="localhost",
            conditions=Conditions(device_type="cuda", amp_dtype="bfloat16"),
        )
        publish_profile(url, profile)
        rows = {
            "no plugins": submitter(bare),
            "plugins, no model": submitter(with_plugins),
            # a new batch each job (8 x (index + 1)), so no answer is cached
            "plugins, cold": submitter(with_plugins, lambda index: model(8 * (index + 1))),
            "plugins, warm": submitter(with_plugins, lambda index: model(256)),
        }
        results = {}
        for name, submit in rows.items():
            submit(args.jobs)  # untimed warm-up: the warm row's answer enters the cache
            results[name] = timed(submit, args.jobs)
            release()
        config.write_text(config.read_text() + "advice = off\n")
        alone = {
            "job_submit only, cold": lambda index: model(8 * (args.jobs + 2 + index)),
            "job_submit only, warm": lambda index: model(256),
        }
        for name, variables in alone.items():
            submit = submitter(with_plugins, variables)
            submit(3 * args.jobs)
            results[name] = timed(submit, args.jobs)
            release()

        def decision(batch: Callable[[int], int]) -> Callable[[int], None]:
            def call(index: int) -> None:
                body = {
                    "model_fingerprint": FINGERPRINT,
                    "effective_batch_size": batch(index),
                    "cards": [CARD],
                    "world_size": 8,
                }
                response = server.client.post("/v1/admissions", json=body)
                assert response.json()["outcome"] == "accepted", response.text

            return call

        results["decision alone, new batches"] = timed(
            decision(lambda i: 8 * (1000 + i)), args.jobs
        )
        results["decision alone, same batch"] = timed(decision(lambda i: 256), args.jobs)
    base = statistics.median(results["no plugins"])
    print(f"sbatch --hold on a one-node Slurm, {args.jobs} submissions each (ms):")
    for name, seconds in results.items():
        p50, p99 = percentiles(seconds)
        ratio = statistics.median(seconds) / base
        print(f"  {name:30s} p50 {p50:8.1f}  p99 {p99:8.1f}  p50 / no plugins {ratio:5.2f}")
    print(f"(cpus {os.cpu_count()}; work in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
