"""The ``autobatch`` command line: parse, call the library, print. No logic of its own.

Commands: ``devices``, ``estimate``, ``tune`` (probe + plan), ``plan``, ``profiles``
(list/show/delete), ``serve``; their flags are :mod:`autobatch.cli.parser`'s. Errors print one
line to stderr and exit non-zero.

Example::

    autobatch tune gpt2 --seq-len 128 --device sim:3GiB --effective-batch-size 256
    autobatch plan --max-micro-batch-size 24 --effective-batch-size 64 --world-size 1,2,4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from autobatch.cli.parser import build_parser
from autobatch.cli.plan_env import remote_plan, write_plan
from autobatch.cli.plan_ranks import plan_ranks
from autobatch.errors import AutobatchError, ConfigError, Remedy
from autobatch.units import format_bytes

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autobatch`` console script; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        args.args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Callable[[argparse.Namespace, TextIO], int] = _COMMANDS[args.command]
    try:
        code = handler(args, sys.stdout)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except AutobatchError as exc:
        print(f"autobatch: error: {exc.describe(_flag_wording)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autobatch: interrupted", file=sys.stderr)
        return 130


_AMP_FLAG_VALUES = {"bfloat16": "bf16", "float16": "fp16"}


def _flag_wording(remedy: Remedy) -> str:
    """A library error's remedy as this command line's flag: ``--allow-inexact``, ``--amp bf16``,
    ``a run without --eval``.

    The one place the CLI words remedies (the library names them by Python argument).
    """
    if not remedy.parameter:
        return remedy.purpose
    flag = "--" + {"amp_dtype": "amp"}.get(remedy.parameter, remedy.parameter).replace("_", "-")
    # ``is``: 1 == True, and --multiple-of 1 is no switch.
    if len(remedy.values) == 1 and remedy.values[0] is True:
        phrase = flag  # a switch
    elif len(remedy.values) == 1 and remedy.values[0] is False:
        phrase = f"a run without {flag}"  # a switch left off
    else:
        values = (_AMP_FLAG_VALUES.get(str(v), str(v)) for v in remedy.values)
        phrase = f"{flag} {' or '.join(values)}"
    return f"{phrase} ({remedy.purpose})" if remedy.purpose else phrase


def _stdout_closed() -> int:
    """Stop quietly when the reader of stdout has gone (``autobatch ... | head``), as Unix tools do.

    Python flushes stdout again at exit, which would print a second ``BrokenPipeError``; pointing
    the descriptor at ``/dev/null`` stops that (the recipe in the Python docs, ``signal`` module).

    Returns:
        141, the status of a Unix tool killed by ``SIGPIPE`` (128 + 13).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


def _output_format(args: argparse.Namespace) -> str:
    return "json" if getattr(args, "json", False) else str(getattr(args, "format", "text"))


def _store(args: argparse.Namespace) -> Any:
    from autobatch.profiles.store import ProfileStore

    return ProfileStore(args.store)


def _devices(args: argparse.Namespace, out: TextIO) -> int:
    from autobatch.device.nvml import list_gpus

    gpus = list_gpus()
    if args.json:
        print(json.dumps([dataclasses.asdict(g) for g in gpus], indent=2), file=out)
        return 0
    if not gpus:
        print("NVML reports no GPUs", file=out)
    for gpu in gpus:
        memory = gpu.memory
        kind = "MIG " if gpu.is_mig else ""
        cuda = "-" if gpu.cuda_index is None else str(gpu.cuda_index)
        line = (
            f"nvml {gpu.nvml_index}  cuda {cuda}  {kind}{gpu.name}  {gpu.uuid}  "
            f"total {_bytes_or_unknown(memory.total_memory_bytes)}  "
            f"free {_bytes_or_unknown(memory.free_memory_bytes)}  "
            f"used {_bytes_or_unknown(memory.used_memory_bytes)}"
        )
        if memory.memory_source != "nvml":
            line += f"  ({memory.memory_source}: {gpu.memory_reason})"
        if not gpu.given:
            line += "  (not given to this container)"
        print(line, file=out)
    return 0


def _print_limit_note(profile: Any, out: TextIO, *, flag_limit: int) -> None:
    """Say so when the search stopped at a limit rather than at the memory's edge: the max
    micro-batch printed is then a cap, not what fits. ``flag_limit`` is --max-micro-batch-size;
    a smaller cap is the largest micro-batch a plan for the effective batch size can use."""
    if profile.stop_kind != "limit":
        return
    size = profile.max_micro_batch_size
    if size >= flag_limit:
        cause = "the --max-micro-batch-size limit"
        fix = "raise the limit to search further"
    else:
        cause = "the largest a plan for this effective batch size uses"
        fix = "nothing larger was tried"
    print(
        f"note: {size} is {cause}, not the memory's: larger micro-batches may fit; {fix}",
        file=out,
    )


def _bytes_or_unknown(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else format_bytes(num_bytes)


def _amp(args: argparse.Namespace) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp or "")


def _load(args: argparse.Namespace) -> Any:
    from autobatch.models.zoo import load_model

    return load_model(
        args.model, seq_len=args.seq_len, image_size=args.image_size, input_shape=args.input_shape
    )


def _estimate(args: argparse.Namespace, out: TextIO) -> int:
    from autobatch.probing.estimator import estimate

    spec = _load(args)
    profile = estimate(
        spec.model,
        spec.sample,
        capacity_bytes=args.capacity,
        optimizer=spec.optimizer,
        loss_fn=spec.loss_fn,
        amp_dtype=_amp(args),
        max_micro_batch_size=args.max_micro_batch_size,
        safety_margin=args.safety_margin,
    )
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2), file=out)
        return 0
    model_line = profile.memory_model
    print(f"model            {spec.name} ({_input(profile.input_shape)})", file=out)
    print(f"capacity         {format_bytes(profile.capacity_bytes)}", file=out)
    print(f"max micro-batch  {profile.max_micro_batch_size}  (estimated)", file=out)
    print(f"recommended      {profile.recommended_micro_batch_size}", file=out)
    _print_limit_note(profile, out, flag_limit=args.max_micro_batch_size)
    if model_line is not None:
        print(
            f"peak memory      {format_bytes(model_line.fixed_bytes)} + "
            f"{format_bytes(model_line.bytes_per_sample)} per sample",
            file=out,
        )
    return 0


def _tune(args: argparse.Namespace, out: TextIO) -> int:
    from autobatch.device import resolve_device
    from autobatch.tuning import TuneRequest, tune_request

    target = resolve_device(_tune_device(args))
    spec = _load(args).to(target.torch_device)
    fmt = _output_format(args)
    progress = _Progress(enabled=fmt == "text")
    try:
        tuned = tune_request(
            TuneRequest(
                model=spec.model,
                sample=spec.sample,
                optimizer=spec.optimizer,
                loss_fn=spec.loss_fn,
                device=target,
                gpu_fraction=args.gpu_fraction,
                amp_dtype=_amp(args),
                safety_margin=args.safety_margin,
                max_micro_batch_size=args.max_micro_batch_size,
                store=args.store,
                use_store=not args.no_store,
                refresh=args.refresh,
                report_to=args.report_to,
                on_trial=progress.trial,
                eval=args.eval,
                mixed_ranks=args.mixed_ranks,
                world_size=args.world_size,
                **_plan_options(args),
            )
        )
    finally:
        progress.close()
    _print_plan(
        tuned.plan,
        fmt,
        out,
        profile=tuned.profile,
        eval_profile=tuned.eval_profile,
        flag_limit=args.max_micro_batch_size,
    )
    return 0


def _tune_device(args: argparse.Namespace) -> str:
    """``--device``, else where the model would train: ``cuda:0`` with CUDA, else ``cpu``;
    says which on stderr."""
    if args.device is not None:
        return str(args.device)
    import torch

    device, why = (
        ("cuda:0", "CUDA is available") if torch.cuda.is_available() else ("cpu", "no CUDA")
    )
    print(f"autobatch: tuning on {device} ({why}; --device chooses)", file=sys.stderr)
    return device


def _plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The plan's flags, as :class:`~autobatch.planning.PlanRequest`'s (and
    :class:`~autobatch.tuning.TuneRequest`'s) fields."""
    return {
        "effective_batch_size": args.effective_batch_size,
        "multiple_of": args.multiple_of,
        "max_gradient_accumulation_steps": args.max_gradient_accumulation_steps,
        "uneven": args.uneven,
        "allow_inexact": args.allow_inexact,
    }


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    from autobatch.planning import (
        PlanRequest,
        budgeted_plan,
        budgeted_table,
        given_budget,
        stored_profile_source,
    )

    if args.model_fingerprint is not None:
        return _remote_plan(args, out)
    if args.rank_max is not None:
        return plan_ranks(args, out, _output_format(args))
    if args.rank_seconds_per_sample is not None:
        raise ConfigError("--rank-seconds-per-sample goes with --rank-max (one per rank)")
    remote_only = [
        flag
        for flag, value in (
            ("--service", args.service),
            ("--card", args.card),
            ("--node", args.node),
            ("--condition", args.condition),
        )
        if value
    ]
    if remote_only:
        raise ConfigError(
            f"{', '.join(remote_only)} choose among a service's stored profiles: give "
            "--model-fingerprint (and --service) with them"
        )
    limit: Any = args.max_micro_batch_size
    source = None
    if args.profile is not None:
        with _store(args) as store:
            limit = store.get(args.profile)
        source = stored_profile_source(limit)
    elif args.capacity is not None:
        raise ConfigError("--capacity needs --profile (a measured memory line to scale)")
    if args.gpu_fraction is not None and args.capacity is None:
        raise ConfigError(
            "--gpu-fraction needs --capacity (the card's memory it is a share of) and --profile"
        )
    budget = capacity = None
    if args.capacity is not None:
        budget = given_budget(args.capacity, gpu_fraction=args.gpu_fraction)
        capacity = budget.budget_bytes
    fmt = _output_format(args)
    if len(args.world_size) == 1:
        request = PlanRequest(
            world_size=args.world_size[0], capacity_bytes=capacity, **_plan_options(args)
        )
        result = budgeted_plan(limit, request, budget=budget, source=source)
        if args.env or args.output:
            write_plan(result.to_dict(), None, args.output, out)
        else:
            _print_plan(result, fmt, out)
        return 0
    if args.env or args.output:
        raise ConfigError("--env and --output take a single --world-size")
    if fmt not in ("text", "json"):
        raise ConfigError(f"--format {fmt} needs a single --world-size")
    request = PlanRequest(
        world_sizes=tuple(args.world_size), capacity_bytes=capacity, **_plan_options(args)
    )
    options = budgeted_table(limit, request, budget=budget, source=source)
    if fmt == "json":
        rows = [
            {
                "world_size": o.world_size,
                "plan": None if o.plan is None else o.plan.to_dict(),
                "reason": o.describe(_flag_wording),
            }
            for o in options
        ]
        print(json.dumps(rows, indent=2), file=out)
        return 0
    print(f"{'world_size':>10}  {'micro_batch':>11}  {'accum_steps':>11}  note", file=out)
    for option in options:
        if option.plan is None:
            print(
                f"{option.world_size:>10}  {'-':>11}  {'-':>11}  {option.describe(_flag_wording)}",
                file=out,
            )
            continue
        p = option.plan
        seconds = p.predicted_seconds_per_effective_batch
        note = "" if seconds is None else f"{seconds:.3f} s per effective batch"
        if p.prediction is not None:  # the max micro-batch is predicted, not measured
            found = p.prediction.largest_measured_micro_batch_size
            where = "past" if p.max_micro_batch_size > found else "below"
            note = "; ".join(filter(None, (note, f"{p.source}: {where} measured {found}")))
        sizes = "x".join(map(str, sorted(set(p.micro_batch_sizes), reverse=True)))
        print(
            f"{p.world_size:>10}  {sizes:>11}  {p.gradient_accumulation_steps:>11}  {note}",
            file=out,
        )
    if budget is not None and args.gpu_fraction is not None:  # after the table, which is first
        _print_budget(budget, out)
    return 0


def _remote_plan(args: argparse.Namespace, out: TextIO) -> int:
    """``plan --model-fingerprint``: the service's plan, as text, JSON or ``--env`` lines."""
    from autobatch.planning import Plan

    answer = remote_plan(args)
    if args.env or args.output:
        write_plan(answer["plan"], answer, args.output, out)
        return 0
    fmt = _output_format(args)
    if fmt == "json":
        print(json.dumps(answer, indent=2), file=out)
        return 0
    _print_plan(Plan.from_dict(answer["plan"]), fmt, out)
    selection = answer.get("selection")
    if fmt == "text" and selection is not None:
        print(
            f"profile                      {selection['profile_id']} ({selection['match']}: "
            f"measured on {selection['device_name']}, node {selection['node_name'] or '?'})",
            file=out,
        )
        for reason in selection["reasons"]:
            print(f"note: {reason}", file=out)
    return 0


def _print_budget(budget: Any, out: TextIO) -> None:
    """The memory budget: the deciding source and the sharing mode, every source, warnings."""
    print(f"memory budget                {budget.describe()}", file=out)
    for reading in budget.readings:
        of = (
            f"{format_bytes(reading.available_bytes)} usable of {format_bytes(reading.total_bytes)}"
        )
        print(f"  {reading.source:<26} {of}", file=out)
    if budget.unseen_sources:
        print(f"  not seen                   {', '.join(budget.unseen_sources)}", file=out)
    if budget.fits_now is not None:
        free = format_bytes(budget.free_now_bytes or 0)
        print(
            f"fits now                     {'yes' if budget.fits_now else 'no'} ({free} free)",
            file=out,
        )
    if budget.trials_per_gpu is not None:
        print(f"trials per GPU               {budget.trials_per_gpu}", file=out)
    for warning in budget.warnings:
        print(f"warning: {warning}", file=out)


def _print_plan(
    result: Any,
    fmt: str,
    out: TextIO,
    *,
    profile: Any = None,
    eval_profile: Any = None,
    flag_limit: int = 0,
) -> None:
    from autobatch.integrations.configs import format_config

    if fmt == "json":
        data = {"plan": result.to_dict()}
        if profile is not None:
            data["profile"] = profile.to_dict()
        if eval_profile is not None:
            data["eval_profile"] = eval_profile.to_dict()
        print(json.dumps(data, indent=2), file=out)
        return
    if fmt != "text":
        print(format_config(result, fmt), file=out)  # type: ignore[arg-type]
        return
    if profile is not None:
        print(
            f"device           {profile.device_name} "
            f"({format_bytes(profile.capacity_bytes)} usable of "
            f"{format_bytes(profile.total_memory_bytes)})",
            file=out,
        )
        print(
            f"max micro-batch  {profile.max_micro_batch_size}  "
            f"(recommended {profile.recommended_micro_batch_size}; {profile.num_trials} trials, "
            f"{profile.num_ooms} OOM, {profile.method})",
            file=out,
        )
        if profile.timings is not None:
            print(f"probe time       {profile.timings.describe()}", file=out)
        _print_limit_note(profile, out, flag_limit=flag_limit)
    print(f"micro_batch_size             {result.micro_batch_size}", file=out)
    print(f"gradient_accumulation_steps  {result.gradient_accumulation_steps}", file=out)
    print(f"world_size                   {result.world_size}", file=out)
    print(f"effective_batch_size         {result.effective_batch_size}", file=out)
    if result.eval_micro_batch_size is not None:
        print(f"eval_micro_batch_size        {result.eval_micro_batch_size}", file=out)
    if len(set(result.micro_batch_sizes)) > 1:
        print(f"micro_batch_sizes            {list(result.micro_batch_sizes)}", file=out)
    if result.rank_micro_batch_sizes is not None:
        print(f"rank_micro_batch_sizes       {list(result.rank_micro_batch_sizes)}", file=out)
    if not result.exact:
        print(f"requested                    {result.requested_effective_batch_size}", file=out)
    if result.predicted_peak_memory_bytes is not None:
        print(
            f"predicted peak               {format_bytes(result.predicted_peak_memory_bytes)}",
            file=out,
        )
    print(f"source                       {result.source}", file=out)
    if result.budget is not None:
        _print_budget(result.budget, out)
    if result.prediction is not None:
        found = result.prediction
        fit = (
            f"{found.num_fit_points} points, largest residual "
            f"{format_bytes(found.fit_residual_bytes)}"
            if found.num_fit_points
            else "the profile's stored line"
        )
        where = (
            "past"
            if result.max_micro_batch_size > found.largest_measured_micro_batch_size
            else "below"
        )
        print(
            f"largest measured             {found.largest_measured_micro_batch_size} "
            f"(predicted {where} it: {fit}; margin +{found.margin:.0%})",
            file=out,
        )
    for note in result.notes:
        print(f"note: {note}", file=out)


def _profiles(args: argparse.Namespace, out: TextIO) -> int:
    with _store(args) as store:
        if args.action == "list":
            rows = store.list_profiles()
            if args.json:
                data = [{"id": pid, **p.to_dict()} for pid, p in rows]
                print(json.dumps(data, indent=2), file=out)
                return 0
            # MODE: an eval profile (a forward only) is no training profile to plan from.
            table = [
                ("ID", "CREATED (UTC)", "DEVICE", "MAX", "MODE", "OPTIMIZER", "INPUT", "MODEL")
            ]
            table += [
                (
                    pid,
                    p.created_at[:16].replace("T", " ") or "-",
                    p.device_name,
                    str(p.max_micro_batch_size),
                    p.mode,
                    p.optimizer or "-",
                    _input(p.input_shape),
                    p.model_fingerprint,
                )
                for pid, p in rows
            ]
            widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
            for row in table:
                cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
                print("  ".join([*cells, row[-1]]), file=out)
            return 0
        if args.action == "show":
            print(json.dumps(store.get(args.profile_id).to_dict(), indent=2), file=out)
            return 0
        if not store.delete(args.profile_id):
            print(f"autobatch: error: no profile {args.profile_id!r}", file=sys.stderr)
            return 1
        print(f"deleted {args.profile_id}", file=out)
        return 0


_SERVICE_EXTRA = "pip install -e '.[service]' in the autobatch checkout"
"""From the checkout: the name ``autobatch`` on PyPI is another project's."""


def _serve(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from service.__main__ import main as serve_main
    except ImportError as exc:
        raise ConfigError(f"the service needs its extras: {_SERVICE_EXTRA} ({exc})") from exc
    forwarded = list(args.args)
    if args.store and "--store-path" not in forwarded:
        forwarded += ["--store-path", args.store]
    try:
        return int(serve_main(forwarded))
    except ImportError as exc:  # fastapi/uvicorn are imported when the server starts
        raise ConfigError(f"the service needs its extras: {_SERVICE_EXTRA} ({exc})") from exc


def _input(shapes: Any) -> str:
    """One sample's shape per input: ``input_ids 512, labels 512``; ``pixels 3x224x224``."""
    return ", ".join(f"{k} {'x'.join(map(str, v)) or 'scalar'}" for k, v in shapes.items()) or "-"


class _Progress:
    """One tqdm line per probe (to stderr); silent when disabled (``--json``, configs)."""

    def __init__(self, *, enabled: bool) -> None:
        self._enabled = enabled
        self._bar: Any = None

    def trial(self, trial: Any) -> None:
        if not self._enabled:
            return
        if self._bar is None:  # created at the first trial: a cached answer shows no bar
            from tqdm import tqdm

            self._bar = tqdm(desc="probing", unit="trial", file=sys.stderr, leave=True)
        outcome = "fits" if trial.fits else ("OOM" if trial.oom else "too big")
        peak = format_bytes(trial.peak_reserved_bytes) if trial.fits else "-"
        self._bar.set_postfix_str(f"micro-batch {trial.micro_batch_size} {outcome}, peak {peak}")
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "devices": _devices,
    "estimate": _estimate,
    "plan": _plan,
    "profiles": _profiles,
    "serve": _serve,
    "tune": _tune,
}
