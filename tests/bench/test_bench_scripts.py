"""The benchmark scripts run end to end on the CPU: ``bench/gpu_check.py --dry-run`` (tiny model,
simulated device instead of CUDA), ``bench/probe_vs_peers.py --quick`` (one model, one capacity),
``bench/service_load.py`` (a few requests), ``bench/accumulate_overhead.py --quick`` (a few
repetitions) and ``bench/ddp_agreement_overhead.py`` (2 gloo ranks, a few repetitions). Each runs in
a subprocess, as it would be run by hand, so Lightning's and Accelerate's warnings (CPU training,
dataloader workers) stay out of this pytest session's ``filterwarnings = error``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], *, timeout_s: float, out_dir: Path | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if out_dir is not None:
        env["OUT"] = str(out_dir)
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.slow  # runs tests/gpu, the stacks, the CLI and one cell in subprocesses
def test_gpu_check_dry_run_prints_the_tables_and_writes_json(tmp_path: Path) -> None:
    out = _run(
        ["bench/gpu_check.py", "--dry-run", "--budget-s", "130"], timeout_s=240, out_dir=tmp_path
    )
    assert "compiled (eager)       ok " in out and "fsdp2 (1 rank)         ok " in out
    assert "Estimator (fake tensors) vs measured peak" in out
    assert "Search for the largest micro-batch" in out
    assert "Probe wall time by part" in out  # the time split the first GPU run shows
    assert "gpt2-tiny" in out and "autobatch" in out
    assert out.rstrip().splitlines()[-1].startswith("medians |")  # the table comes last
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["env"]["dry_run"] is True
    assert result["errors"] == []
    assert result["rows"][0]["autobatch"]["micro_batch_size"] >= 1
    timings = result["rows"][0]["timings"]
    assert timings["total_seconds"] >= sum(timings["trial_seconds"]) > 0
    assert result["rows"][0]["bisection"]["num_trials"] == 17  # warm-up + 16 over 1..65536
    assert [row["case"] for row in result["stacks"]] == ["compiled (eager)", "fsdp2 (1 rank)"]
    tuned = result["cli_tune"]  # the CLI's own road, as on the GPU with --device cuda:0
    assert (tuned["rc"], tuned["device_name"]) == (0, "sim"), tuned
    assert tuned["micro_batch_size"] * tuned["gradient_accumulation_steps"] == 256


@pytest.mark.slow
def test_probe_vs_peers_quick_prints_every_tool_and_the_targets() -> None:
    out = _run(["bench/probe_vs_peers.py", "--quick"], timeout_s=240)  # with the regimes
    for tool in ("autobatch", "lightning", "accelerate", "exhaustive"):
        assert f" {tool} " in out
    assert "medians | autobatch:" in out
    assert out.count("target ") == 4
    # one failure pattern the peaks do not predict, its six goals (the bound in search trials,
    # every real step counted within ceil(log2(limit)) + 3 and within the stated worst case,
    # the exact max, against Lightning + 2, against the best peer), and the wall time in both
    # regimes with its two goals; then the pure search over every threshold under 256, its
    # six goals (the last: a right line's 1 OOM and 4 real steps)
    assert "oom-above-37" in out and out.count("goal ") == 14
    sweep = out[out.index("every threshold 1..256") :].splitlines()
    assert sum(line.startswith("goal MET ") for line in sweep) == 6
    regimes = [line.split() for line in out.splitlines() if line.split()[1:2] in (["gpu"], ["cpu"])]
    assert [(row[0], row[1]) for row in regimes] == [
        ("mlp-adam", "gpu"),
        ("mlp-adam", "cpu"),
        ("oom-above-37", "gpu"),
        ("oom-above-37", "cpu"),
    ]
    for row in regimes:
        assert all(float(value) > 0 for value in row[2:3] + row[4:7]), row  # measured seconds


@pytest.mark.slow
def test_service_load_runs_both_servers_and_prints_the_ratios() -> None:
    out = _run(
        # Enough requests that each server's CPU time spans several /proc clock ticks (10 ms):
        # with 60 the trivial server's can read 0.
        ["bench/service_load.py", "--requests", "600", "--rounds", "2", "--concurrency", "1", "4"],
        timeout_s=180,
    )
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"])]
    # conc, endpoint..., req/s, p50, p99, server CPU per request: all measured, all positive.
    assert [(row[0], row[-5]) for row in rows] == [
        (level, endpoint)
        for level in ("1", "4")
        for endpoint in ("/v1/plan", "(service)", "(bare)", "(node)", "(card)", "(node=)")
    ]
    for row in rows:
        assert all(float(value) > 0 for value in row[-4:]), row
    for baseline in ("service", "bare"):
        goals = [line for line in out.splitlines() if f"plan/empty ({baseline}): p99 " in line]
        assert len(goals) == 2 and all("server CPU per request " in g for g in goals), out
    for node in ("(node)", "(node=)"):
        cards = [line for line in out.splitlines() if f"plan (card)/plan {node}: p99 " in line]
        assert len(cards) == 2 and all(" ms = " in line for line in cards), out


@pytest.mark.slow
def test_accumulate_overhead_quick_prints_each_workload_with_its_interval() -> None:
    out = _run(["bench/accumulate_overhead.py", "--quick"], timeout_s=180)
    for workload in ("tiny", "mlp", "gpt2"):
        assert f"{workload}: 6 interleaved repetitions" in out
    rows = [line.split() for line in out.splitlines() if "paired ratio" in line]
    # Per workload: the A/A control, the Accumulator, Window.run raise and split (against the
    # hand-written loop), and split against raise.
    assert len(rows) == 15
    for row in rows:
        ratio = float(row[row.index("ratio") + 1])
        assert 0.2 < ratio < 5.0, row  # a measured ratio of two timed loops, not a constant
    assert out.count("target < 2%:") == 6
    assert out.count("run split / run raise paired ratio") == 3


@pytest.mark.slow
def test_ddp_agreement_overhead_prints_the_paired_ratio_of_two_gloo_ranks() -> None:
    out = _run(
        ["bench/ddp_agreement_overhead.py", "--repetitions", "4", "--windows", "2"], timeout_s=120
    )
    assert "2 gloo ranks, MLP width 256" in out and "4 interleaved repetitions" in out
    (row,) = [line.split() for line in out.splitlines() if "paired ratio" in line]
    ratio = float(row[row.index("ratio") + 1])
    assert 0.2 < ratio < 5.0, row  # a measured ratio of two timed loops, not a constant
    assert "target < 2%:" in out


@pytest.mark.slow
def test_store_publish_counts_every_profile_on_both_backends(postgres_url: str) -> None:
    out = _run(
        ["bench/store_publish.py", "--publishers", "3", "--each", "20", "--postgres", postgres_url],
        timeout_s=300,
    )
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    for backend in ("sqlite", "postgresql"):
        assert "stored 60  lost 0  duplicates 0" in lines[backend], out


def test_healthz_under_load_prints_both_phases_and_the_ratio() -> None:
    out = _run(["bench/healthz_under_load.py", "--samples", "5", "--clients", "2"], timeout_s=180)
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}
    for phase in ("idle", "loaded"):
        samples, median, tail = rows[phase]
        assert samples == "5" and 0 < float(median) <= float(tail)
    assert "ratio loaded/idle: p50 " in out and "x, p99 " in out
    answered = next(line for line in out.splitlines() if line.startswith("costly requests"))
    assert "plan 200: " in answered and "profile 201: " in answered
    assert "goal: loaded p99 under 100 ms: " in out
