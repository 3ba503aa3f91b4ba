"""The ``autobatch`` command line: parse, call the library, print. No logic of its own.

Commands: ``devices``, ``estimate``, ``tune`` (probe + plan), ``plan``, ``launcher``,
``profiles`` (list/show/delete), ``serve``; their flags are :mod:`autobatch.cli._parser`'s.
Errors print one line to stderr and exit non-zero.

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
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from autobatch.cli._launcher import run_launcher
from autobatch.cli._output import (
    bytes_or_unknown,
    input_shapes,
    print_budget,
    print_limit_note,
    print_measured_under,
    print_plan,
    print_table,
    trials_run_now,
)
from autobatch.cli._parser import build_parser, unknown_arguments
from autobatch.cli._plan_env import remote_plan, write_plan
from autobatch.cli._plan_ranks import plan_ranks
from autobatch.cli._profiles import print_profile, print_profile_table
from autobatch.cli._progress import Progress, ProgressLog
from autobatch.cli._wording import error_words, reason_words, warning_words
from autobatch.device import list_gpus
from autobatch.errors import AutobatchError, ConfigError, MissingExtraError, ReportWarning
from autobatch.extras import require
from autobatch.planning import (
    Plan,
    PlanRequest,
    given_budget,
    plan_request,
    plan_table,
    stored_profile_source,
)
from autobatch.store import STORE_ENV_VAR, Create, ProfileStore
from autobatch.units import format_bytes

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autobatch`` console script; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        args.args = extra
    elif extra:
        parser.error(unknown_arguments(parser, extra))  # unknown flags before the command
    handler: Callable[[argparse.Namespace, TextIO], int] = _COMMANDS[args.command]
    try:
        code = handler(args, sys.stdout)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except AutobatchError as exc:
        given = sys.argv[1:] if argv is None else argv
        return _error(args, error_words(exc, parser, args.command, given), exc)
    except OSError as exc:  # a path the user named that cannot be read or written
        path = exc.filename.removesuffix(".partial") if isinstance(exc.filename, str) else ""
        what = f"{path}: " if path else ""
        words = f"{what}{exc.strerror or exc}; check that the path and its folder exist and are "
        words += "writable"
        return _error(args, words, exc)
    except KeyboardInterrupt:
        print("autobatch: interrupted", file=sys.stderr)
        return 130


def _error(args: argparse.Namespace, words: str, exc: Exception) -> int:
    """Print an error as argparse prints its own, so every error of a command reads alike:
    ``autobatch plan: error: ...``; a refused input (:class:`ConfigError`, as argparse's own
    refusals; not a missing extra, which no flag fixes) adds the ``try 'autobatch plan --help'``
    line. Exits 1: what the library refuses after parsing (argparse's own refusals exit 2)."""
    prog = " ".join(["autobatch", *filter(None, [args.command, getattr(args, "action", None)])])
    print(f"{prog}: error: {words}", file=sys.stderr)
    if isinstance(exc, ConfigError) and not isinstance(exc, MissingExtraError):
        print(f"try '{prog} --help'", file=sys.stderr)
    return 1


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


def _store(args: argparse.Namespace, *, writing: bool = False) -> Any:
    """The store ``--store`` (else ``$AUTOBATCH_STORE``, else the default file) names.

    A mistyped location is an error, never a new empty store: reading needs the store to exist,
    and writing creates its file only in an existing folder, but for the default location's
    (``~/.cache/autobatch``), which is made when missing.
    """
    default = args.store is None and not os.environ.get(STORE_ENV_VAR)
    create: Create = "never" if not writing else ("folders" if default else "file")
    return ProfileStore(args.store, create=create)


def _devices(args: argparse.Namespace, out: TextIO) -> int:
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
            f"total {bytes_or_unknown(memory.total_memory_bytes)}  "
            f"free {bytes_or_unknown(memory.free_memory_bytes)}  "
            f"used {bytes_or_unknown(memory.used_memory_bytes)}"
        )
        if memory.memory_source != "nvml":
            line += f"  ({memory.memory_source}: {gpu.memory_reason})"
        if not gpu.given:
            line += "  (not given to this container)"
        print(line, file=out)
    return 0


def _amp(args: argparse.Namespace) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp or "")


def _load(args: argparse.Namespace) -> Any:
    # torch-bound: only the commands that run a step load torch
    from autobatch.models import load_model

    return load_model(
        args.model, seq_len=args.seq_len, image_size=args.image_size, input_shape=args.input_shape
    )


ESTIMATE_BOUND_NOTE = (
    "note: predicted on fake tensors, not measured (no CUDA context, library workspaces or "
    "allocator caching): a real step's peak can differ by any factor, and the probe calls an "
    "estimate off by more than 25% unreliable; `autobatch tune` measures it"
)
"""What ``estimate`` says of its numbers: how far from a measurement they may be."""


def _estimate(args: argparse.Namespace, out: TextIO) -> int:
    # torch-bound: only the commands that run a step load torch
    from autobatch.probing import estimate

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
    print(f"model            {spec.name} ({input_shapes(profile.input_shape)})", file=out)
    print(f"capacity         {format_bytes(profile.capacity_bytes)}", file=out)
    print(
        f"recommended      {profile.recommended_micro_batch_size}  (predicted maximum "
        f"{profile.max_micro_batch_size}: a fake-tensor estimate, no real step ran)",
        file=out,
    )
    print_limit_note(profile, out, flag_limit=args.max_micro_batch_size)
    if model_line is not None:
        print(
            f"predicted peak   {format_bytes(model_line.fixed_bytes)} + "
            f"{format_bytes(model_line.bytes_per_sample)} per sample",
            file=out,
        )
        print(ESTIMATE_BOUND_NOTE, file=out)
    return 0


def _tune(args: argparse.Namespace, out: TextIO) -> int:
    # The road is torch-bound: only the commands that run a step load torch. resolve_device is
    # read from the device face when called, where tests replace it.
    from autobatch.device import resolve_device

    target = resolve_device(_tune_device(args))
    spec = _load(args).to(target.torch_device)
    fmt = _output_format(args)
    progress = Progress(
        enabled=fmt == "text",
        word=warning_words(build_parser(), "tune"),
        name_modes=args.activation_checkpointing != "none",
    )
    store = None if args.no_store else _store(args, writing=True)
    unreported: list[Warning | str] = []  # the report's failure, if any (shown as a warning)

    def show(message: Warning | str, *_: Any, **__: Any) -> None:
        if isinstance(message, ReportWarning):
            unreported.append(message)
        progress.warning(message)

    try:
        with warnings.catch_warnings(), ProgressLog.attached(progress):
            # The command shows its warnings (once each), whatever the caller's filters, and
            # writes them above the progress line, in flags, not glued onto it.
            warnings.simplefilter("default", UserWarning)
            warnings.showwarning = show
            tuned = _tuned(args, spec, target, progress, store)
    except AutobatchError as exc:
        if args.report is not None:  # the page draws a plan: say so rather than write none
            exc.args = (
                f"{exc.message}; --report {args.report}: no page was written, for no plan "
                "came back to draw (the modes tried and their trials are named here)",
                *exc.args[1:],
            )
        raise
    finally:
        progress.close()
        if store is not None:
            store.close()
    print_plan(
        tuned.plan,
        fmt,
        out,
        profile=tuned.profile,
        eval_profile=tuned.eval_profile,
        flag_limit=args.max_micro_batch_size,
        checkpointing=tuned.checkpointing,
    )
    if args.report_to is not None and not unreported:
        print(_reported_words(args.report_to, tuned), file=sys.stderr)
    if args.report is not None:
        from autobatch.tuning import report_html

        try:
            Path(args.report).write_text(report_html(tuned), encoding="utf-8")
        except OSError as exc:  # the plan is printed above; the page could not be written
            raise ConfigError(
                f"--report {args.report}: cannot write the page ({exc.strerror}); give a "
                "writable file in an existing folder"
            ) from None
        print(f"autobatch: report written to {args.report}", file=sys.stderr)
    return 0


def _reported_words(url: str, tuned: Any) -> str:
    """``tune --report-to``'s one line on what it sent: the profile just measured, or the
    stored one that answered (its probe did not run now; timing trials that did are said)."""
    if tuned.plan.source == "cached":
        now = trials_run_now(tuned.checkpointing)
        if now != "nothing ran now":
            now += ", and are not part of it"
        return (
            f"autobatch: sent the stored profile to {url} ({now}; the service stores a "
            "profile it holds once)"
        )
    return f"autobatch: sent the profile to {url}"


def _tuned(args: argparse.Namespace, spec: Any, target: Any, progress: Progress, store: Any) -> Any:
    """The tuning road for ``tune``'s flags, its events drawn by ``progress``."""
    from autobatch.tuning import TuneRequest, tune_request

    return tune_request(
        TuneRequest.build(
            spec.model,
            spec.sample,
            optimizer=spec.optimizer,
            loss_fn=spec.loss_fn,
            device=target,
            gpu_fraction=args.gpu_fraction,
            amp_dtype=_amp(args),
            safety_margin=args.safety_margin,
            max_micro_batch_size=args.max_micro_batch_size,
            store=store,
            use_store=not args.no_store,
            refresh=args.refresh,
            report_to=args.report_to,
            model_name=spec.name,
            on_trial=progress.trial,
            on_stage=progress.stage,
            eval=args.eval,
            mixed_ranks=args.mixed_ranks,
            activation_checkpointing=args.activation_checkpointing,
            checkpoint_block_class=args.checkpoint_block_class,
            world_size=args.world_size,
            **_plan_options(args),
        )
    )


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
        result = plan_request(limit, request, budget=budget, source=source)
        if args.env or args.output:
            measured = getattr(limit, "max_micro_batch_size", None)  # a stored profile's
            write_plan(
                result.to_dict(), None, args.output, out, measured_max_micro_batch_size=measured
            )
        else:
            print_plan(result, fmt, out)
        return 0
    if args.env or args.output:
        raise ConfigError("--env and --output take a single --world-size")
    if fmt not in ("text", "json"):
        raise ConfigError(f"--format {fmt} needs a single --world-size")
    request = PlanRequest(
        world_sizes=tuple(args.world_size), capacity_bytes=capacity, **_plan_options(args)
    )
    print_table(plan_table(limit, request, budget=budget, source=source), fmt, out)
    if fmt == "text" and budget is not None and args.gpu_fraction is not None:
        print_budget(budget, out)  # after the table, which comes first
    return 0


def _remote_plan(args: argparse.Namespace, out: TextIO) -> int:
    """``plan --model-fingerprint``: the service's plan, as text, JSON or ``--env`` lines."""
    answer = remote_plan(args)
    if args.env or args.output:
        write_plan(answer["plan"], answer, args.output, out)
        return 0
    fmt = _output_format(args)
    if fmt == "json":
        print(json.dumps(answer, indent=2), file=out)
        return 0
    print_plan(Plan.from_dict(answer["plan"]), fmt, out)
    selection = answer.get("selection")
    if fmt == "text" and selection is not None:
        print(
            f"profile                      {selection['profile_id']} ("
            f"{'' if selection['match'] == 'measured' else selection['match'] + ', '}"
            f"measured on {selection['device_name']}, node {selection['node_name'] or '?'})",
            file=out,
        )
        print_measured_under(selection, out, asked=dict(args.condition or ()))
        for reason in selection["reasons"]:
            print(f"note: {reason_words(reason)}", file=out)
    return 0


def _profiles(args: argparse.Namespace, out: TextIO) -> int:
    with _store(args) as store:
        if args.action == "list":
            rows = store.list_profiles()
            if args.json:
                data = [{"id": pid, **p.to_dict()} for pid, p in rows]
                print(json.dumps(data, indent=2), file=out)
                return 0
            print_profile_table(rows, out)
            return 0
        if args.action == "show":
            profile = store.get(args.profile_id)
            if args.json:
                print(json.dumps(profile.to_dict(), indent=2), file=out)
            else:
                print_profile(args.profile_id, profile, out)
            return 0
        if not store.delete(args.profile_id):
            print(
                f"autobatch profiles delete: error: no profile {args.profile_id!r}", file=sys.stderr
            )
            return 1
        print(f"deleted {args.profile_id}", file=out)
        return 0


def _serve(args: argparse.Namespace, out: TextIO) -> int:
    # service/__init__ requires its extra's modules: a missing one is named, not a traceback.
    serve_main = require("service.__main__", extra="service", purpose="autobatch serve").main
    forwarded = list(args.args)
    if args.store and "--store-path" not in forwarded:
        forwarded += ["--store-path", args.store]
    return int(serve_main(forwarded))


_COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "devices": _devices,
    "estimate": _estimate,
    "launcher": run_launcher,
    "plan": _plan,
    "profiles": _profiles,
    "serve": _serve,
    "tune": _tune,
}
