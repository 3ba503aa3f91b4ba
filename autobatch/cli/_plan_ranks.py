"""``autobatch plan --rank-max N ...``: a micro-batch per rank for ranks on mixed cards, from each
rank's largest micro-batch (and, with ``--rank-seconds-per-sample``, its speed), by the pure
planner :func:`autobatch.planning.plan_mixed_ranks`; no torch.

Example::

    autobatch plan --rank-max 48 --rank-max 17 --effective-batch-size 96
    autobatch plan --rank-max 48 --rank-max 17 --rank-seconds-per-sample 0.004 \\
        --rank-seconds-per-sample 0.0065 --effective-batch-size 96 --json
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from autobatch.cli._output import note_flags
from autobatch.cli._wording import cli_message
from autobatch.errors import ConfigError
from autobatch.integrations import format_config
from autobatch.planning import PlanRequest, RankLimit, StepLine, plan_mixed_ranks

__all__ = ["plan_ranks"]

_LOCAL_ONLY = (
    ("--profile", "profile"),
    ("--capacity", "capacity"),
    ("--gpu-fraction", "gpu_fraction"),
    ("--service", "service"),
    ("--card", "card"),
    ("--node", "node"),
    ("--condition", "condition"),
    ("--env", "env"),
    ("--output", "output"),
    ("--uneven", None),
    ("--allow-inexact", "allow_inexact"),
)


def plan_ranks(args: argparse.Namespace, out: TextIO, fmt: str) -> int:
    """Print the mixed plan of ``args.rank_max`` (text: one line per rank; ``json``: every
    rank's plan; a framework format is refused by :mod:`autobatch.integrations._configs`).

    Raises:
        ConfigError: a flag that does not go with ``--rank-max`` (named), a ``--world-size``
            other than the number of ``--rank-max``, or ``--rank-seconds-per-sample`` given for
            another number of ranks; the planner's errors (NoFeasiblePlanError with the nearest
            reachable effective batches).
    """
    maxima = list(args.rank_max)
    given = [flag for flag, name in _LOCAL_ONLY if name and getattr(args, name, None)]
    if args.uneven != "auto":
        given.append("--uneven")
    if given:
        raise ConfigError(
            f"{', '.join(given)} do(es) not go with --rank-max: a mixed plan is made from the "
            "ranks' maxima alone, and meets the effective batch exactly or names the nearest"
        )
    if args.world_size not in ([1], [len(maxima)]):
        raise ConfigError(
            f"--world-size {','.join(map(str, args.world_size))} is not the number of --rank-max "
            f"given ({len(maxima)}): give one --rank-max per rank"
        )
    seconds = args.rank_seconds_per_sample
    if seconds is not None and len(seconds) != len(maxima):
        raise ConfigError(
            f"{len(seconds)} --rank-seconds-per-sample for {len(maxima)} --rank-max: give one "
            "per rank, in rank order, or none"
        )
    ranks = [
        RankLimit(
            max_micro_batch_size=maximum,
            step_line=None if seconds is None else StepLine(per_sample_seconds=seconds[index]),
        )
        for index, maximum in enumerate(maxima)
    ]
    request = PlanRequest(
        effective_batch_size=args.effective_batch_size,
        world_size=len(ranks),
        multiple_of=args.multiple_of,
        max_gradient_accumulation_steps=args.max_gradient_accumulation_steps,
    )
    plans = plan_mixed_ranks(ranks, request)
    # The notes in the command line's words, in text and JSON alike (as ``print_plan``).
    notes = [cli_message(note, note_flags(), bare=False) for note in plans[0].notes]
    if fmt == "json":
        rows = [{**p.to_dict(), "notes": notes} for p in plans]
        print(json.dumps({"ranks": rows}, indent=2), file=out)
        return 0
    if fmt != "text":
        print(format_config(plans[0], fmt), file=out)  # type: ignore[arg-type]  # refuses
        return 0
    first = plans[0]
    print(f"{'rank':>4}  {'max':>6}  {'micro-batch':>11}", file=out)
    for rank, p in enumerate(plans):
        print(f"{rank:>4}  {p.max_micro_batch_size:>6}  {p.micro_batch_size:>11}", file=out)
    print(f"gradient_accumulation_steps  {first.gradient_accumulation_steps}", file=out)
    print(f"effective_batch_size         {first.effective_batch_size}", file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    return 0
