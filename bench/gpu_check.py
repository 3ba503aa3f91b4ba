"""One prepared check on a real GPU: the gpu-marked tests, autobatch beside its peers, and the
estimator's error against measured peaks, in under 8 minutes.

1. ``pytest tests/gpu -m gpu`` once (a subprocess, bounded by the budget), then the CLI as a
   user runs it: ``autobatch tune gpt2-tiny ... --device cuda:0 --json`` (a subprocess).
2. For GPT-2 124M and BERT-base (transformers configs, random weights, sequence ``--seq-len``)
   at capacities cut by ``torch.cuda.set_per_process_memory_fraction`` to 16, 40 and 80 GiB:
   autobatch's probe, Lightning's BatchSizeFinder (binsearch), Accelerate's
   ``find_executable_batch_size`` (starting at twice the exhaustive max) and the exhaustive scan,
   all on ``cuda:0`` (a :class:`~autobatch.device._cuda.CudaDevice`); see ``bench/_peers.py``.
3. Estimator error: for each size autobatch measured as fitting, the fake-tensor peak
   (:class:`autobatch.probing._estimator.FakeStep`) against ``torch.cuda.max_memory_allocated`` and
   ``max_memory_reserved`` of the real step at the same size.
4. Modern stacks (``bench/_stacks.py``): a torch.compile'd model (inductor; Dynamo frames
   counted, compilation still working after the probe) and an FSDP2 model on a one-rank group,
   at the smallest capacity; run before the cells, so that the budget cannot skip them.
5. Activation checkpointing chosen with the micro-batch (``bench/activation_checkpointing.py``):
   GPT-2-, Llama- and BERT-shaped configs probed within 2 GiB of the card with
   ``activation_checkpointing="auto"``, the chosen plan's measured time per sample beside no
   checkpointing and full checkpointing at their largest micro-batches.

A global time budget (``--budget-s``, default 450 s from start) is checked before every piece of
work; what no longer fits is skipped and listed. Tables are printed last; with ``$OUT`` set the
results also go to ``$OUT/gpu_check.json``.

``--dry-run`` runs the same code on the CPU with tiny models and a
:class:`~autobatch.SimulatedDevice` per capacity (GPT-2 tiny at 8 and 12 MiB), so it can be tested
anywhere.

Usage (from the repository root)::

    PYTHONPATH=. python bench/gpu_check.py
    PYTHONPATH=. python bench/gpu_check.py --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from autobatch import SimulatedDevice
from autobatch.device import Device
from autobatch.probing import BatchSource, FakeStep
from autobatch.profile import ProbeTimings, Profile
from bench._peers import (
    GIB,
    MIB,
    TINY_CASES,
    Case,
    ToolResult,
    format_capacity,
    format_summary,
    format_table,
    real_cases,
    run_accelerate,
    run_autobatch,
    run_bisection,
    run_exhaustive,
    run_lightning,
    summarize,
)
from bench._stacks import check_compiled, check_fsdp2, format_stacks

MIN_SECONDS_PER_CELL = 45.0
"""A (model, capacity) cell is started only with at least this much budget left (GPU run)."""

MAX_EXHAUSTIVE_SECONDS = 60.0
"""The exhaustive scan of one cell stops after this long (its result is then a lower bound)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, simulated device")
    parser.add_argument("--budget-s", type=float, default=450.0, help="time budget (default 450)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    parser.add_argument(
        "--capacities-gib", type=float, nargs="+", default=[16.0, 40.0, 80.0], help="GPU only"
    )
    parser.add_argument("--skip-pytest", action="store_true", help="do not run tests/gpu")
    return parser.parse_args(argv)


class Budget:
    """Seconds left of a global budget; records what was skipped for lack of time."""

    def __init__(self, seconds: float) -> None:
        self.started = time.perf_counter()
        self.deadline = self.started + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, what: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.skipped.append(f"{what} (needs ~{need_s:.0f} s, {max(0.0, self.left()):.0f} s left)")
        return False


def run_pytest(budget: Budget, *, dry_run: bool) -> dict[str, Any]:
    """``pytest tests/gpu -m gpu`` in a subprocess; returns rc, seconds and the summary line."""
    timeout = min(150.0, budget.left() - 30.0)
    if not budget.allows("pytest tests/gpu -m gpu", 30.0 if dry_run else 60.0):
        return {"ran": False}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ran": True, "rc": None, "summary": f"timed out after {timeout:.0f} s"}
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return {
        "ran": True,
        "rc": done.returncode,
        "seconds": time.perf_counter() - started,
        "summary": lines[-1] if lines else "",
        "tail": lines[-30:] if done.returncode not in (0, 5) else [],
    }


def run_cli_tune(budget: Budget, *, dry_run: bool) -> dict[str, Any]:
    """``autobatch tune gpt2-tiny ... --device cuda:0`` as a user runs it (a subprocess, this
    tree first on the path): the CLI's own road onto the GPU (``sim:16MiB`` in a dry run)."""
    if not budget.allows("autobatch tune (CLI)", 20.0 if dry_run else 60.0):
        return {"ran": False}
    device = "sim:16MiB" if dry_run else "cuda:0"
    command = [sys.executable, "-m", "autobatch", "tune", "gpt2-tiny", "--seq-len", "32"]
    command += ["--device", device, "--effective-batch-size", "256", "--no-store", "--json"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=min(120.0, budget.left()),
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"ran": True, "device": device, "rc": None, "error": "timed out"}
    result: dict[str, Any] = {
        "ran": True,
        "device": device,
        "rc": done.returncode,
        "seconds": time.perf_counter() - started,
    }
    if done.returncode != 0:
        result["error"] = done.stderr.strip().splitlines()[-1:] or [""]
        return result
    answer = json.loads(done.stdout)
    result.update(
        device_name=answer["profile"]["device_name"],
        max_micro_batch_size=answer["profile"]["max_micro_batch_size"],
        micro_batch_size=answer["plan"]["micro_batch_size"],
        gradient_accumulation_steps=answer["plan"]["gradient_accumulation_steps"],
        source=answer["plan"]["source"],
    )
    return result


def measure_estimator_error(
    case: Case, device: Device, profile: Profile, *, max_sizes: int = 2
) -> list[dict[str, Any]]:
    """Fake-tensor peak vs the probe's measured peak at the largest fitting sizes it tried."""
    fitted = sorted(
        {t.micro_batch_size: t for t in profile.trials if t.fits and not t.warm_up}.items()
    )[-max_sizes:]
    if not fitted:
        return []
    model, sample, optimizer = case.build(device.torch_device)
    fake = FakeStep(model, optimizer, BatchSource.from_sample(sample), loss_fn=case.loss_fn)
    del model, sample, optimizer
    gc.collect()
    device.release()
    out = []
    for size, trial in fitted:
        estimated = fake.peak_bytes(size)
        out.append(
            {
                "micro_batch_size": size,
                "estimated_bytes": estimated,
                "measured_allocated_bytes": trial.peak_allocated_bytes,
                "measured_reserved_bytes": trial.peak_reserved_bytes,
                "error_vs_allocated": estimated / trial.peak_allocated_bytes - 1,
                "error_vs_reserved": estimated / trial.peak_reserved_bytes - 1,
            }
        )
    return out


def _guarded(errors: list[str], what: str, run: Callable[[], Any]) -> Any:
    """Run one tool; a failure is recorded (and printed) instead of ending the whole check."""
    try:
        return run()
    except Exception as exc:
        errors.append(
            f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        traceback.print_exc()
        return None


def run_cell(
    case: Case,
    capacity_bytes: int,
    *,
    make_device: Callable[[], Device],
    accelerator: str,
    budget: Budget,
    errors: list[str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """All tools on one (case, capacity); returns the table row and the estimator errors."""
    label = f"{case.name}@{format_capacity(capacity_bytes)}"
    row: dict[str, Any] = {"case": case.name, "capacity_bytes": capacity_bytes}
    deadline = time.perf_counter() + min(MAX_EXHAUSTIVE_SECONDS, max(1.0, budget.left() / 3))
    row["exhaustive"] = _guarded(
        errors,
        f"{label} exhaustive",
        lambda: run_exhaustive(case, make_device(), deadline=deadline),
    ) or ToolResult(
        tool="exhaustive",
        micro_batch_size=0,
        num_trials=0,
        num_steps=0,
        num_ooms=0,
        seconds=0.0,
        note="failed",
    )
    estimator: list[dict[str, Any]] = []
    probed = _guarded(errors, f"{label} autobatch", lambda: run_autobatch(case, make_device()))
    if probed is not None:
        row["autobatch"], profile = probed
        row["timings"] = profile.timings
        row["method"] = profile.method
        bisection = _guarded(
            errors,
            f"{label} bisection",
            lambda: run_bisection(case, make_device(), limit=1 << 16),
        )
        if bisection is not None:
            row["bisection"] = bisection
        estimator = (
            _guarded(
                errors,
                f"{label} estimator",
                lambda: measure_estimator_error(case, make_device(), profile),
            )
            or []
        )
        for item in estimator:
            item.update(case=case.name, capacity_bytes=capacity_bytes)
    if budget.allows(f"{label} lightning", 10.0):
        row["lightning"] = _guarded(
            errors,
            f"{label} lightning",
            lambda: run_lightning(case, make_device(), accelerator=accelerator),
        )
    if budget.allows(f"{label} accelerate", 5.0):
        start = 2 * max(
            row["exhaustive"].micro_batch_size,
            row.get("autobatch") and row["autobatch"].micro_batch_size or 1,
            1,
        )
        row["accelerate"] = _guarded(
            errors,
            f"{label} accelerate",
            lambda: run_accelerate(case, make_device(), starting_micro_batch_size=start),
        )
    return row, estimator


def _set_cuda_capacity(capacity_bytes: int, total_bytes: int) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, capacity_bytes / total_bytes), 0)
    torch.cuda.reset_peak_memory_stats(0)


def format_estimator(items: list[dict[str, Any]]) -> str:
    header = (
        f"{'model':<18} {'capacity':>9} {'micro':>6} {'estimated':>10} {'allocated':>10} "
        f"{'reserved':>10} {'err/alloc':>9} {'err/resv':>9}"
    )
    lines = [header, "-" * len(header)]
    for item in items:
        lines.append(
            f"{item['case']:<18} {format_capacity(item['capacity_bytes']):>9} "
            f"{item['micro_batch_size']:>6} {item['estimated_bytes'] / MIB:>9.1f}M "
            f"{item['measured_allocated_bytes'] / MIB:>9.1f}M "
            f"{item['measured_reserved_bytes'] / MIB:>9.1f}M "
            f"{item['error_vs_allocated']:>+9.1%} {item['error_vs_reserved']:>+9.1%}"
        )
    return "\n".join(lines)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {
        key: dataclasses.asdict(value) if isinstance(value, (ToolResult, ProbeTimings)) else value
        for key, value in row.items()
    }


def format_timings(rows: list[dict[str, Any]]) -> str:
    """autobatch's wall time by part (Profile.timings) beside plain bisection over real steps."""
    header = (
        f"{'case':<18} {'capacity':>9} {'road':<8} {'total s':>8} {'estimate':>9} "
        f"{'fake':>4} {'s/fake':>7} {'real s':>8} {'trials':>6} {'s/real':>7} "
        f"{'cleanup':>8} {'bisect s':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        timings: ProbeTimings | None = row.get("timings")
        if timings is None:
            continue
        fakes = timings.fake_step_seconds
        trials = timings.trial_seconds
        bisection: ToolResult | None = row.get("bisection")
        lines.append(
            f"{row['case']:<18} {format_capacity(row['capacity_bytes']):>9} "
            f"{row.get('method', ''):<8} {timings.total_seconds:>8.3f} "
            f"{timings.estimate_seconds:>9.3f} {len(fakes):>4} "
            f"{(sum(fakes) / len(fakes) if fakes else 0):>7.3f} {sum(trials):>8.3f} "
            f"{len(trials):>6} {(sum(trials) / len(trials) if trials else 0):>7.3f} "
            f"{sum(timings.cleanup_seconds):>8.3f} "
            f"{(bisection.seconds if bisection is not None else float('nan')):>8.3f}"
        )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """What the check runs on: the cases, the capacities, where, and the environment's record."""

    cases: list[Case]
    capacities: list[int]
    """Capacities of the cells, in bytes, smallest first (the budget cuts the dearest cells)."""
    accelerator: str
    """Lightning's accelerator: ``"gpu"`` or ``"cpu"``."""
    total_bytes: int
    """The GPU's total memory (0 on a dry run)."""
    env: dict[str, Any]


def choose_target(args: argparse.Namespace) -> Target | None:
    """The dry run's tiny case on simulated cards, or the real cases on ``cuda:0``; None when a
    real run finds no CUDA device."""
    env: dict[str, Any] = {"torch": torch.__version__, "dry_run": args.dry_run}
    if args.dry_run:
        torch.set_num_threads(2)
        env["device"] = "simulated (CPU)"
        return Target(
            cases=[c for c in TINY_CASES if c.name == "gpt2-tiny"],
            capacities=[8 * MIB, 12 * MIB],  # maxima of about 9 and 15: seconds, not minutes
            accelerator="cpu",
            total_bytes=0,
            env=env,
        )
    if not torch.cuda.is_available():
        return None
    total_bytes = torch.cuda.get_device_properties(0).total_memory
    env.update(
        device=torch.cuda.get_device_name(0),
        total_memory_bytes=total_bytes,
        cuda=torch.version.cuda,
    )
    return Target(
        cases=list(real_cases(args.seq_len)),
        capacities=[int(c * GIB) for c in args.capacities_gib],
        accelerator="gpu",
        total_bytes=total_bytes,
        env=env,
    )


def run_stacks(
    args: argparse.Namespace, target: Target, budget: Budget, errors: list[str]
) -> list[dict[str, Any]]:
    """The modern stacks (torch.compile, FSDP2), one row each; failures appended to ``errors``."""
    stacks: list[dict[str, Any]] = []
    if not budget.allows("modern stacks (compiled, FSDP2)", 10.0 if args.dry_run else 90.0):
        return stacks
    if args.dry_run:
        backend, width, depth = "eager", 32, 2

        def stack_device() -> Device:
            return SimulatedDevice(capacity_bytes=1 * MIB)
    else:
        from autobatch.device import CudaDevice

        backend, width, depth = "inductor", 1024, 4
        _set_cuda_capacity(min(target.capacities), target.total_bytes)
        stack_cuda = CudaDevice(0)

        def stack_device() -> Device:
            return stack_cuda

    for what, check in (
        (
            "compiled",
            lambda: check_compiled(stack_device, backend=backend, width=width, depth=depth),
        ),
        ("fsdp2", lambda: check_fsdp2(stack_device, width=width, depth=depth)),
    ):
        row = _guarded(errors, f"stacks {what}", check)
        if row is not None:
            stacks.append(row)
            if not row["ok"]:
                errors.append(f"stacks {what}: {row}")
    return stacks


def run_checkpointing(
    args: argparse.Namespace, target: Target, budget: Budget, errors: list[str]
) -> list[dict[str, Any]]:
    """Activation checkpointing chosen with the micro-batch beside none and full at their
    largest (:func:`bench.activation_checkpointing.gpu_check_rows`); failures in ``errors``."""
    from bench.activation_checkpointing import gpu_check_rows

    return gpu_check_rows(
        dry_run=args.dry_run,
        total_bytes=target.total_bytes,
        allows=budget.allows,
        guarded=functools.partial(_guarded, errors),
    )


def run_cells(
    args: argparse.Namespace, target: Target, budget: Budget, errors: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (capacity, case) cell the budget allows: the search rows and the estimator's."""
    rows: list[dict[str, Any]] = []
    estimator: list[dict[str, Any]] = []
    for capacity in target.capacities:  # smallest first: the budget cuts the most expensive
        for case in target.cases:
            label = f"{case.name}@{format_capacity(capacity)}"
            if not args.dry_run and capacity > 0.95 * target.total_bytes:
                budget.skipped.append(
                    f"{label} (over 95% of the {target.total_bytes / GIB:.0f} GiB device)"
                )
                continue
            if not budget.allows(label, 5.0 if args.dry_run else MIN_SECONDS_PER_CELL):
                continue
            print(f"{label} ... ({budget.left():.0f} s left)", file=sys.stderr, flush=True)
            if args.dry_run:

                def make_device(capacity: int = capacity) -> Device:
                    return SimulatedDevice(capacity_bytes=capacity)
            else:
                from autobatch.device import CudaDevice

                _set_cuda_capacity(capacity, target.total_bytes)
                cuda_device = CudaDevice(0)

                def make_device(device: Device = cuda_device) -> Device:
                    return device

            row, errs = run_cell(
                case,
                capacity,
                make_device=make_device,
                accelerator=target.accelerator,
                budget=budget,
                errors=errors,
            )
            rows.append(row)
            estimator.extend(errs)
    if not args.dry_run:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    return rows, estimator


def print_report(result: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The check's tables, as a person reads them (the JSON holds the same)."""
    env, pytest_result = result["env"], result["pytest"]
    print()
    print(
        f"device: {env.get('device')}  torch {torch.__version__}  "
        f"elapsed {result['elapsed_seconds']:.0f} s"
    )
    print(
        f"pytest tests/gpu -m gpu: {pytest_result.get('summary', 'not run')} "
        f"(rc {pytest_result.get('rc')})"
    )
    for line in pytest_result.get("tail", []):
        print(f"  | {line}")
    print(f"autobatch tune (CLI): {result['cli_tune']}")
    for item in result["skipped"]:
        print(f"SKIPPED (time budget or device size): {item}")
    for item in result["errors"]:
        print(f"ERROR: {item}")
    print()
    print("Modern stacks (torch.compile, FSDP2):")
    print(format_stacks(result["stacks"]))
    print()
    if result["checkpointing"]:
        from bench.activation_checkpointing import format_rows

        print("Activation checkpointing chosen with the micro-batch (time per sample, measured):")
        print(format_rows(result["checkpointing"]))
        print()
    print("Estimator (fake tensors) vs measured peak at the same micro-batch:")
    print(format_estimator(result["estimator"]))
    print()
    print(
        "Probe wall time by part (Profile.timings, device clock) beside plain bisection over "
        "real steps (1..65536):"
    )
    print(format_timings(rows))
    print()
    print("Search for the largest micro-batch (found / exhaustive max; trials, steps, OOMs):")
    print(format_table(rows))
    if rows:
        print(format_summary(summarize(rows)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    errors: list[str] = []
    target = choose_target(args)
    if target is None:
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    pytest_result = {"ran": False} if args.skip_pytest else run_pytest(budget, dry_run=args.dry_run)
    print(f"pytest: {pytest_result}", file=sys.stderr, flush=True)
    cli_tune = run_cli_tune(budget, dry_run=args.dry_run)  # its own process, the whole card
    print(f"autobatch tune: {cli_tune}", file=sys.stderr, flush=True)
    if cli_tune.get("ran") and cli_tune.get("rc") != 0:
        errors.append(f"autobatch tune --device {cli_tune['device']}: {cli_tune}")
    stacks = run_stacks(args, target, budget, errors)
    checkpointing = run_checkpointing(args, target, budget, errors)
    rows, estimator = run_cells(args, target, budget, errors)
    result = {
        "env": target.env,
        "pytest": pytest_result,
        "cli_tune": cli_tune,
        "rows": [_jsonable(row) for row in rows],
        "summary": summarize(rows) if rows else {},
        "estimator": estimator,
        "stacks": stacks,
        "checkpointing": checkpointing,
        "skipped": budget.skipped,
        "errors": errors,
        "elapsed_seconds": time.perf_counter() - budget.started,
        "budget_seconds": args.budget_s,
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(result, f, indent=2, default=str)
    print_report(result, rows)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
