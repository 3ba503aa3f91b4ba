"""The ``autobatch`` command's arguments: the subcommands, their flags, and each flag's type.

Only parsing: the values are checked as argparse types (a bad one exits 2 naming it); what the
commands do with them is :mod:`autobatch.cli._commands`'s. A parsing error is one line and a
pointer to ``--help``, never the whole usage: a mistyped flag names the nearest one
(``unknown option --effective-batchsize; did you mean --effective-batch-size?``), and a global
flag given after the command says where it goes.

Example::

    args = build_parser().parse_args(["plan", "--max-micro-batch-size", "24",
                                      "--effective-batch-size", "64"])
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from autobatch import __version__
from autobatch.cli._plan_env import parse_condition
from autobatch.conditions import one_world_size
from autobatch.errors import ConfigError
from autobatch.margin import DEFAULT_SAFETY_MARGIN, check_safety_margin
from autobatch.planning import MAX_GRADIENT_ACCUMULATION_STEPS
from autobatch.store import redact
from autobatch.units import parse_capacity

__all__ = ["FORMATS", "build_parser", "unknown_arguments"]

_T = TypeVar("_T")

FORMATS = ("text", "json", "deepspeed", "hf", "lightning")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that name the nearest flag or command.

    Python 3.11's argparse has no ``suggest_on_error``; this is the one place the command line
    suggests. Subcommands are built of this class too (argparse's default ``parser_class``).
    """

    global_options: tuple[str, ...] = ()
    """The top-level parser's flags (``--store``), which a subcommand's error points back to."""
    passes_unknown = False
    """True for ``serve``, which hands the arguments it does not know to the service."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and not self.passes_unknown and not self._commands():
            self.error(unknown_arguments(self, extras))
        assert parsed is not None
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        """Exit 2 with ``PROG: error: MESSAGE`` and one line pointing to ``--help``.

        A mistyped flag makes argparse complain of what it lacks (a required flag, a command);
        the mistyped flag is the cause, so it is named instead.
        """
        unknown = _unknown_options(self, getattr(self, "_given", []))
        if unknown and (not message.startswith("argument ") or "invalid choice" in message):
            message = unknown_arguments(self, unknown)
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
        if choice is not None:
            near = difflib.get_close_matches(choice[2], self._commands() or (), n=1)
            if near:
                message += f"; did you mean {near[0]!r}?"
        self.exit(2, f"{self.prog}: error: {message}\ntry '{self.prog} --help'\n")

    def _commands(self) -> list[str]:
        """This parser's subcommand names, empty for a leaf."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return list(action.choices)
        return []


def _known(parser: argparse.ArgumentParser, option: str) -> bool:
    """True when ``option`` is one of the parser's flags or (argparse abbreviates) the start of
    exactly one of them."""
    flags = parser._option_string_actions
    return option in flags or sum(flag.startswith(option) for flag in flags) == 1


def _unknown_options(parser: _Parser, given: Sequence[str]) -> list[str]:
    """The flags in ``given`` that ``parser`` does not know, each with the value after it;
    for a parser with subcommands, only those before the command."""
    commands = parser._commands()
    unknown: list[str] = []
    for index, token in enumerate(given):
        if token in commands or token == "--":
            break
        option = token.partition("=")[0]
        if option.startswith("-") and not _NUMBER.match(option) and not _known(parser, option):
            unknown.extend(given[index : index + 2])
    return unknown


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def unknown_arguments(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The error for arguments ``parser`` did not take: the first unknown flag with the nearest
    known one (or where it goes, for a global flag given after the command), else the stray
    values.

    Args:
        parser: the (sub)command's parser that was left with ``extras``.
        extras: what it did not take, in order, e.g. ``["--effective-batchsize", "96"]``.
    """
    for token in extras:
        option = token.partition("=")[0]
        if not option.startswith("-") or _NUMBER.match(option):
            continue
        global_options = getattr(parser, "global_options", ())
        if option in global_options:
            index = list(extras).index(token)
            value = extras[index + 1 : index + 2] if "=" not in token else []
            if option == "--store":  # a URL's password is never shown
                token = f"--store={redact(token[8:])}" if "=" in token else token
                value = [redact(text) for text in value]
            moved = " ".join([token, *value])
            command = parser.prog.partition(" ")[2]
            return f"{option} goes before the command: autobatch {moved} {command} ..."
        flags = sorted({flag for flag in parser._option_string_actions if flag.startswith("--")})
        near = difflib.get_close_matches(option, flags, n=1, cutoff=0.65)
        if near:
            return f"unknown option {option}; did you mean {near[0]}?"
        return f"unknown option {option}; the flags are {', '.join(flags)}"
    return f"unexpected argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}"


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _int_list(text: str) -> list[int]:
    """Whole numbers >= 1 separated by commas, each once (``1,2,4,8``), as the HTTP field takes
    them: an empty item (``1,,2``) or a repeated one (``4,4``) is refused, never dropped."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"{text!r} holds no number; e.g. 1,2,4,8")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; e.g. 1,2,4,8")
    values = [_positive_int(part) for part in parts]
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        again = ", ".join(str(value) for value in repeated)
        raise argparse.ArgumentTypeError(f"{text!r} lists {again} more than once; give each once")
    return values


def _bytes(text: str) -> int:
    try:
        return parse_capacity(text)
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


def _number(text: str) -> float:
    """A number, parsed only: its range is the library's one check (the request's), whose
    error the CLI shows in flag spelling."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _margin(text: str) -> float:
    """A safety margin, checked by the library's one check as the flags are read (before a
    model loads, which can take a minute)."""
    try:
        return check_safety_margin(_number(text))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("safety_margin ", "", 1)) from None


def _per_rank(read: Callable[[str], _T], example: str) -> Callable[[str], list[_T]]:
    """One value per rank, in rank order, as one flag's comma list (``24,12``) or the flag once
    per rank (``--rank-max 24 --rank-max 12``): ranks may repeat a value (``24,24,12``)."""

    def values(text: str) -> list[_T]:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item; e.g. {example}")
        return [read(part) for part in parts]

    return values


def _whole_number(text: str) -> int:
    """A whole number, parsed only: its range is the library's one check (the request's)."""
    try:
        return int(text)
    except ValueError:
        if text.isdigit():  # past Python's int_max_str_digits
            raise argparse.ArgumentTypeError(
                f"the number given has {len(text)} digits, more than Python reads "
                f"({sys.get_int_max_str_digits()}); give a smaller one"
            ) from None
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


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
    parser.add_argument(
        "--image-size", type=_positive_int, help="pixels per side of an image model (default: 224)"
    )
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
        help=f"capacity kept free (default: {DEFAULT_SAFETY_MARGIN})",
    )
    parser.add_argument(
        "--max-micro-batch-size",
        type=_whole_number,
        default=1 << 16,  # autobatch.probing.DEFAULT_SEARCH_LIMIT, without importing torch
        help="the search cap: the largest micro-batch tried (default: 65536)",
    )


class _OneSpelling(argparse.Action):
    """``--world-size`` and its alias ``--data-parallel-size``, one setting: given again under
    either spelling, the values are reconciled by :func:`autobatch.conditions.one_world_size`
    (different values are an error, not last-wins)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen = f"_{self.dest}_given_as"
        earlier = getattr(namespace, seen, None)
        if earlier is not None:
            before = getattr(namespace, self.dest)
            try:
                one_world_size(before, values)
            except ConfigError:
                parser.error(
                    f"{option_string} {_listed(values)} disagrees with {earlier} "
                    f"{_listed(before)}: "
                    f"{' and '.join(self.option_strings)} are one setting; give it once"
                )
        setattr(namespace, seen, option_string)
        setattr(namespace, self.dest, values)


def _listed(values: Any) -> str:
    """A flag's value as the user wrote it: ``1,2,4`` for a list, never ``[1, 2, 4]``."""
    return ",".join(map(str, values)) if isinstance(values, list) else str(values)


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
            "parallelism); a list (1,2,4,8) prints a table (default: 1)",
        )
    else:
        parser.add_argument(
            "--world-size",
            "--data-parallel-size",
            dest="world_size",
            action=_OneSpelling,
            type=_positive_int,
            default=None,
            help="data-parallel ranks (model replicas, not GPUs, under tensor/pipeline "
            "parallelism) (default: the launcher's, torchrun's WORLD_SIZE, Slurm's..., else 1)",
        )
    parser.add_argument(
        "--multiple-of",
        type=_positive_int,
        default=1,
        help="every micro-batch size a multiple of this, e.g. 8 for tensor cores; above 1 rules "
        "out unequal sizes (default: 1)",
    )
    parser.add_argument(
        "--max-gradient-accumulation-steps",
        type=_positive_int,
        metavar="N",
        help="the most accumulation steps per optimizer step (default: the planner's own bound, "
        f"{MAX_GRADIENT_ACCUMULATION_STEPS:,} steps)",
    )
    parser.add_argument(
        "--uneven",
        choices=("auto", "never", "always"),
        default="auto",
        help="unequal micro-batches, differing by at most 1, each loss weighted by its size: "
        "auto when equal sizes would need more than twice the fewest accumulation steps; never "
        "(equal sizes only); always (the fewest steps) (default: auto)",
    )
    parser.add_argument(
        "--allow-inexact", action="store_true", help="reach the nearest effective batch size"
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (default: text)"
    )
    parser.add_argument("--json", action="store_true", help="same as --format json")


def build_parser() -> argparse.ArgumentParser:
    """The whole flag set: global options, then one subparser per command."""
    parser = _Parser(
        prog="autobatch", description="Memory-aware micro-batch auto-tuner for PyTorch training."
    )
    parser.add_argument(
        "--store",
        help="profile store: a file, :memory: or a postgresql:// URL (default: $AUTOBATCH_STORE)",
    )
    parser.add_argument("--version", action="version", version=f"autobatch {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND --help)"
    )

    devices = commands.add_parser("devices", help="list GPUs via NVML")
    devices.add_argument("--json", action="store_true", help="print JSON")

    estimate = commands.add_parser("estimate", help="largest micro-batch, on fake tensors")
    _add_model_args(estimate)
    estimate.add_argument("--capacity", type=_bytes, required=True, help="e.g. 80GiB")
    estimate.add_argument("--json", action="store_true", help="print the profile as JSON")

    _add_tune_command(commands)
    _add_plan_command(commands)
    _add_launcher_command(commands)
    _add_profiles_command(commands)

    # The service owns its flags (service.web.settings); `autobatch serve --help` lists them.
    serve = commands.add_parser(
        "serve", help="run the HTTP service (see serve --help)", add_help=False
    )
    serve.passes_unknown = True
    _point_back(parser)
    return parser


def _add_tune_command(commands: Any) -> None:
    """``tune``: probe the device, then plan."""
    tune = commands.add_parser("tune", help="probe the device, then plan")
    _add_model_args(tune)
    _add_plan_args(tune, world_sizes=False)
    tune.add_argument(
        "--device",
        help="cuda:N, cpu or sim:SIZE, e.g. sim:3GiB (default: cuda:0 with CUDA, else cpu)",
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
        "--activation-checkpointing",
        choices=("auto", "none", "selective", "full"),
        default="none",
        help="checkpoint the model's repeated blocks: none (the model as given), selective "
        "(every 2nd), full, or auto: probe each mode by real trials and plan with the fastest "
        "that reaches the effective batch, the notes say which modes ran and why (default: none)",
    )
    tune.add_argument(
        "--report",
        metavar="FILE",
        help="write an HTML page (inline SVG, no external assets) of peak memory and time per "
        "sample against micro-batch for each mode tried, the budget line, every trial (OOMs "
        "marked) and the chosen point",
    )
    tune.add_argument(
        "--checkpoint-block-class",
        metavar="NAME",
        help="the class name of the blocks to checkpoint (default: every list of layers, "
        "a transformers model's layers, a hybrid stack, an encoder-decoder's both stacks; "
        "never a list of single Linears); one "
        "that matches no module is refused, whatever the mode",
    )
    tune.add_argument(
        "--mixed-ranks",
        action="store_true",
        help="a micro-batch per rank (cards of different memory or speed); run it on every "
        "rank under a launcher (torchrun): each probes its own card",
    )


def _add_plan_command(commands: Any) -> None:
    """``plan``: from a size, a stored profile, a capacity, or a service's profiles."""
    plan = commands.add_parser("plan", help="plan from a size, a stored profile or a capacity")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--max-micro-batch-size",
        type=_positive_int,
        help="the limit to plan within: the largest micro-batch known to fit",
    )
    source.add_argument(
        "--rank-max",
        type=_per_rank(_positive_int, "24,24,12"),
        action="extend",
        metavar="N[,N...]",
        help="each rank's largest micro-batch in rank order, as a comma list (24,12) or the "
        "flag once per rank (ranks on mixed cards): a micro-batch per rank",
    )
    source.add_argument("--profile", help="stored profile id (see `autobatch profiles list`)")
    source.add_argument(
        "--model-fingerprint",
        help="plan from a service's stored profiles of this model (with --service)",
    )
    _add_plan_args(plan, world_sizes=True)
    plan.add_argument(
        "--rank-seconds-per-sample",
        type=_per_rank(_seconds, "0.004,0.009"),
        action="extend",
        metavar="SECONDS[,SECONDS...]",
        help="with --rank-max: each rank's step seconds per sample in rank order, as a comma "
        "list or the flag once per rank",
    )
    plan.add_argument("--capacity", type=_bytes, help="another device's capacity, with --profile")
    _add_fraction_arg(plan, extra=" (--capacity)")
    plan.add_argument(
        "--service",
        help="the autobatch service to ask, with --model-fingerprint "
        "(default: $AUTOBATCH_CENTRAL_URL)",
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


def _add_launcher_command(commands: Any) -> None:
    """``launcher``: the ranks the launcher's environment describes."""
    launcher = commands.add_parser(
        "launcher", help="the ranks the launcher's environment describes (docs/launchers.md)"
    )
    launcher.add_argument(
        "--slurm-task-ranks",
        choices=("one", "gpus"),
        default="one",
        help="a Slurm task is one rank, or starts one per GPU it holds (a TaskProlog, before "
        "a torchrun per node) (default: one)",
    )
    shown = launcher.add_mutually_exclusive_group()
    shown.add_argument("--world-size", action="store_true", help="print the world size only")
    shown.add_argument("--json", action="store_true", help="print the layout as JSON")


def _add_profiles_command(commands: Any) -> None:
    """``profiles list|show|delete``."""
    profiles = commands.add_parser("profiles", help="stored profiles")
    actions = profiles.add_subparsers(
        dest="action", required=True, metavar="ACTION", help="what to do with them"
    )
    listing = actions.add_parser("list", help="one line per stored profile, newest first")
    listing.add_argument("--json", action="store_true", help="print the profiles as JSON")
    show = actions.add_parser("show", help="one profile, in words (JSON with --json)")
    show.add_argument("profile_id", help="its id (see autobatch profiles list)")
    show.add_argument("--json", action="store_true", help="print the profile as JSON")
    delete = actions.add_parser("delete", help="remove one profile from the store")
    delete.add_argument("profile_id", help="its id (see autobatch profiles list)")


def _point_back(parser: _Parser) -> None:
    """Tell every subcommand's parser the global flags, for its error on one given after it."""
    global_options = tuple(f for f in parser._option_string_actions if f.startswith("--"))
    pending = [parser]
    while pending:
        current = pending.pop()
        current.global_options = global_options
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
