"""The ``autobatch`` command's arguments: the subcommands, their flags, and each flag's type.

Only parsing: the values are checked as argparse types (a bad one exits 2 naming it); what the
commands do with them is :mod:`autobatch.cli.commands`'s.

Example::

    args = build_parser().parse_args(["plan", "--max-micro-batch-size", "24",
                                      "--effective-batch-size", "64"])
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from autobatch import __version__
from autobatch.cli.plan_env import parse_condition
from autobatch.errors import ConfigError
from autobatch.margin import DEFAULT_SAFETY_MARGIN, check_safety_margin
from autobatch.units import parse_bytes

__all__ = ["FORMATS", "build_parser"]

FORMATS = ("text", "json", "deepspeed", "hf", "lightning")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        if text.isdigit():  # past Python's int_max_str_digits
            raise argparse.ArgumentTypeError(
                f"the number given has {len(text)} digits, more than Python reads "
                f"({sys.get_int_max_str_digits()}); give a smaller one"
            ) from None
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _int_list(text: str) -> list[int]:
    values = [_positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} holds no number; e.g. 1,2,4,8")
    return values


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape ({exc}): write one sample's sizes, whole numbers separated "
            "by commas, e.g. 3,224,224"
        ) from None


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return check_safety_margin(value)  # the library's one check of the range
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{value} must be in (0, 1]: the share of the card the job gets, e.g. 0.5"
        )
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{value} must be finite seconds >= 0, e.g. 0.004")
    return value


def _add_fraction_arg(parser: argparse.ArgumentParser, *, extra: str) -> None:
    parser.add_argument(
        "--gpu-fraction",
        type=_fraction,
        help="the share of the card the job gets, e.g. 0.5 for two jobs on one card (Ray's "
        f"num_gpus=0.5): plan for that share of its memory{extra}",
    )


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="built-in (gpt2, bert-base, vit-base, llama-small, gpt2-tiny) or module:factory",
    )
    parser.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="tokens per sample (default: the model's maximum, the worst case to probe with)",
    )
    parser.add_argument("--image-size", type=_positive_int, default=224, help="pixels per side")
    parser.add_argument(
        "--input-shape", type=_shape, help="one sample's shape for a bare model, e.g. 3,224,224"
    )
    parser.add_argument(
        "--amp", choices=("bf16", "fp16"), help="autocast forward and loss in this dtype"
    )
    parser.add_argument(
        "--safety-margin",
        type=_margin,
        default=DEFAULT_SAFETY_MARGIN,
        help=f"capacity kept free (default {DEFAULT_SAFETY_MARGIN})",
    )
    parser.add_argument(
        "--max-micro-batch-size", type=_positive_int, default=1 << 16, help="largest size tried"
    )


class _OneSpelling(argparse.Action):
    """An option with several spellings (``--world-size`` / ``--data-parallel-size``) given
    once: two spellings, or one twice, with different values are an error, not last-wins."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen = f"_{self.dest}_given_as"
        earlier = getattr(namespace, seen, None)
        if earlier is not None and getattr(namespace, self.dest) != values:
            parser.error(
                f"{option_string} {values} disagrees with {earlier} {getattr(namespace, self.dest)}"
                f": {' and '.join(self.option_strings)} are one setting; give it once"
            )
        setattr(namespace, seen, option_string)
        setattr(namespace, self.dest, values)


def _add_plan_args(parser: argparse.ArgumentParser, *, world_sizes: bool) -> None:
    parser.add_argument(
        "--effective-batch-size",
        type=_positive_int,
        required=True,
        help="samples per optimizer step",
    )
    if world_sizes:
        parser.add_argument(
            "--world-size",
            "--data-parallel-size",
            dest="world_size",
            action=_OneSpelling,
            type=_int_list,
            default=[1],
            help="data-parallel ranks (model replicas, not GPUs, under tensor/pipeline "
            "parallelism); a list (1,2,4,8) prints a table",
        )
    else:
        parser.add_argument(
            "--world-size",
            "--data-parallel-size",
            dest="world_size",
            action=_OneSpelling,
            type=_positive_int,
            default=1,
            help="data-parallel ranks (model replicas, not GPUs, under tensor/pipeline "
            "parallelism)",
        )
    parser.add_argument("--multiple-of", type=_positive_int, default=1)
    parser.add_argument("--max-gradient-accumulation-steps", type=_positive_int)
    parser.add_argument("--uneven", choices=("auto", "never", "always"), default="auto")
    parser.add_argument(
        "--allow-inexact", action="store_true", help="reach the nearest effective batch size"
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format")
    parser.add_argument("--json", action="store_true", help="same as --format json")


def build_parser() -> argparse.ArgumentParser:
    """The whole flag set: global options, then one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="autobatch", description="Memory-aware micro-batch auto-tuner for PyTorch training."
    )
    parser.add_argument(
        "--store",
        help="profile store: a file, :memory: or a postgresql:// URL (default $AUTOBATCH_STORE)",
    )
    parser.add_argument("--version", action="version", version=f"autobatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    devices = commands.add_parser("devices", help="list GPUs via NVML")
    devices.add_argument("--json", action="store_true")

    estimate = commands.add_parser("estimate", help="largest micro-batch, on fake tensors")
    _add_model_args(estimate)
    estimate.add_argument("--capacity", type=_bytes, required=True, help="e.g. 80GiB")
    estimate.add_argument("--json", action="store_true")

    tune = commands.add_parser("tune", help="probe the device, then plan")
    _add_model_args(tune)
    _add_plan_args(tune, world_sizes=False)
    tune.add_argument(
        "--device",
        help="cuda:N, cpu or sim:SIZE (e.g. sim:3GiB); default cuda:0 with CUDA, else cpu",
    )
    _add_fraction_arg(tune, extra="")
    tune.add_argument("--refresh", action="store_true", help="probe again, ignoring the store")
    tune.add_argument("--no-store", action="store_true", help="neither read nor write the store")
    tune.add_argument(
        "--report-to",
        metavar="URL",
        help="publish a newly probed profile to this autobatch service (e.g. the central one), "
        "retried; a failure warns",
    )
    tune.add_argument(
        "--eval",
        action="store_true",
        help="also probe the evaluation micro-batch (forward under inference_mode, eval mode)",
    )
    tune.add_argument(
        "--mixed-ranks",
        action="store_true",
        help="a micro-batch per rank (cards of different memory or speed); run it on every "
        "rank under a launcher (torchrun): each probes its own card",
    )

    plan = commands.add_parser("plan", help="plan from a size, a stored profile or a capacity")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--max-micro-batch-size", type=_positive_int)
    source.add_argument(
        "--rank-max",
        type=_positive_int,
        action="append",
        metavar="N",
        help="one rank's largest micro-batch, once per rank in rank order (ranks on mixed "
        "cards): a micro-batch per rank",
    )
    source.add_argument("--profile", help="stored profile id (see `autobatch profiles list`)")
    source.add_argument(
        "--model-fingerprint",
        help="plan from a service's stored profiles of this model (with --service)",
    )
    _add_plan_args(plan, world_sizes=True)
    plan.add_argument(
        "--rank-seconds-per-sample",
        type=_seconds,
        action="append",
        metavar="SECONDS",
        help="with --rank-max: one rank's step seconds per sample, once per rank in rank order",
    )
    plan.add_argument("--capacity", type=_bytes, help="another device's capacity, with --profile")
    _add_fraction_arg(plan, extra=" (--capacity)")
    plan.add_argument(
        "--service",
        help="the autobatch service to ask (default $AUTOBATCH_CENTRAL_URL), with "
        "--model-fingerprint",
    )
    plan.add_argument("--card", help="plan for this card type, e.g. 'NVIDIA H100 80GB HBM3'")
    plan.add_argument("--node", help="plan for this node (its own profile first)")
    plan.add_argument(
        "--condition",
        action="append",
        type=parse_condition,
        metavar="NAME=VALUE",
        help="a condition the plan must hold under, e.g. amp_dtype=bfloat16 (repeatable)",
    )
    plan.add_argument(
        "--env",
        action="store_true",
        help="print shell export lines (AUTOBATCH_MICRO_BATCH_SIZE=...) instead",
    )
    plan.add_argument(
        "--output",
        help="write the export lines to this file (JSON for a .json path) instead of stdout",
    )

    profiles = commands.add_parser("profiles", help="stored profiles")
    actions = profiles.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list")
    listing.add_argument("--json", action="store_true")
    show = actions.add_parser("show")
    show.add_argument("profile_id")
    delete = actions.add_parser("delete")
    delete.add_argument("profile_id")

    # The service owns its flags (service.settings); `autobatch serve --help` lists them.
    commands.add_parser("serve", help="run the HTTP service (see serve --help)", add_help=False)
    return parser
