"""What the ``autobatch`` command line prints: plans, tables, budgets, the probe's notes and its
progress; the library's words in them as this command line's flags (:mod:`autobatch.cli._wording`).

Example::

    print_plan(plan, "text", sys.stdout)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from importlib import metadata
from typing import Any, TextIO

from autobatch.cli._parser import build_parser
from autobatch.cli._wording import (
    FLAGS,
    cli_message,
    command_flags,
    condition_words,
    flag_wording,
)
from autobatch.integrations import format_config
from autobatch.units import format_bytes


@functools.cache
def note_flags() -> dict[str, str]:
    """The flags a plan's notes may name (``uneven='auto'``): ``plan``'s, which ``tune`` shares,
    and ``tune``'s own (``checkpoint_block_class=``: ``--checkpoint-block-class``)."""
    parser = build_parser()
    return command_flags(parser, "tune") | command_flags(parser, "plan")


def print_measured_under(selection: dict[str, Any], out: TextIO, *, asked: dict[str, Any]) -> None:
    """What a service's profile was measured under (its ``selection.measured_under``), and a note
    where this machine's torch differs from it and ``--condition`` did not ask for one."""
    under = selection.get("measured_under") or {}
    where = ("node_name", "device_name")  # the profile line names them
    shown = ", ".join(
        condition_words(name, value) for name, value in under.items() if name not in where
    )
    print(f"measured under               {shown or 'nothing recorded'}", file=out)
    theirs, here = under.get("torch_version"), installed_version("torch")
    if theirs and here and theirs != here and "torch_version" not in asked:
        print(
            f"note: the profile was measured under torch {theirs}, this machine has torch "
            f"{here}: --condition torch_version={here} asks for a profile measured under it "
            "(a plan from another torch is predicted)",
            file=out,
        )


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (``"2.13.0"``), ``""`` when not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


def print_limit_note(profile: Any, out: TextIO, *, flag_limit: int) -> None:
    """Say so when the search stopped short of the memory's edge: at a limit (the max micro-batch
    printed is then a cap, not what fits), or at a prediction one trial confirmed.
    ``flag_limit`` is --max-micro-batch-size; a smaller cap is the largest micro-batch a plan
    for the effective batch size can use."""
    if profile.confirms_prediction:
        print(
            f"note: {profile.max_micro_batch_size} was predicted from another card's profile and "
            "confirmed by one trial here, not searched to this card's memory edge: larger "
            "micro-batches may fit; --refresh probes this card",
            file=out,
        )
        return
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


def print_probe_time(profile: Any, out: TextIO, *, stored: bool, checkpointing: Any = None) -> None:
    """The probe's wall time by part; for a profile read from the store, said to be that
    profile's, with its date (no probe ran now). With ``checkpointing`` (what
    ``--activation-checkpointing auto`` tried: :class:`autobatch.tuning.CheckpointingOutcome`),
    first every mode's time and trials, then the chosen mode's probe by part."""
    label = "probe time      "
    if checkpointing is not None:
        print(f"probe time       {checkpointing.probe_time()}", file=out)
        label = f"  {checkpointing.chosen}'s probe".ljust(16)
    if profile.timings is None or (stored and not profile.created_at):
        return
    text = profile.timings.describe()
    if stored:
        when = profile.created_at[:16].replace("T", " ")
        text += f"  (the stored profile's, probed {when} UTC; {trials_run_now(checkpointing)})"
    print(f"{label} {text}", file=out)


def trials_run_now(checkpointing: Any) -> str:
    """What ran now beside a stored profile: nothing, or the timing trials ``"auto"`` ran at
    a plan's own micro-batch (counted in the probe time line above)."""
    ran = 0 if checkpointing is None else sum(run.num_trials for run in checkpointing.runs)
    if ran == 0:
        return "nothing ran now"
    return f"its probe did not run now; {ran} timing trial{'' if ran == 1 else 's'} did"


def bytes_or_unknown(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else format_bytes(num_bytes)


def print_budget(budget: Any, out: TextIO) -> None:
    """The memory budget: the deciding source and the sharing mode, every source, warnings; a
    source the user gave by flag (``capacity_bytes``) named as that flag (``--capacity``)."""
    decided = f"decided by {FLAGS.get(budget.deciding_source, budget.deciding_source)}"
    print(
        f"memory budget                {format_bytes(budget.budget_bytes)}, {decided} "
        f"(sharing: {budget.sharing_mode})",
        file=out,
    )
    for reading in budget.readings:
        of = (
            f"{format_bytes(reading.available_bytes)} usable of {format_bytes(reading.total_bytes)}"
        )
        print(f"  {FLAGS.get(reading.source, reading.source):<26} {of}", file=out)
    if budget.unseen_sources:
        print(f"  not seen                   {', '.join(budget.unseen_sources)}", file=out)
    if budget.fits_now is not None:
        free = format_bytes(budget.free_now_bytes or 0)
        print(
            f"fits now                     {'yes' if budget.fits_now else 'no'} ({free} free)",
            file=out,
        )
    if budget.trials_per_gpu is not None:
        print(f"jobs that fit one GPU        {budget.trials_per_gpu}", file=out)
    for warning in budget.warnings:
        print(f"warning: {cli_message(warning, FLAGS)}", file=out)


def print_budget_moved(profile: Any, budget: Any, out: TextIO) -> None:
    """Say why the probe's usable bytes and the plan's budget differ, when they do: each was
    read when it was made, and free memory moves with other processes (on a host, always)."""
    if profile is None or profile.capacity_bytes == budget.budget_bytes:
        return
    print(
        f"note: the probe saw {format_bytes(profile.capacity_bytes)} usable; the plan's memory "
        f"budget, {format_bytes(budget.budget_bytes)}, was read again when planning (free "
        "memory moves with other processes)",
        file=out,
    )


def print_plan(
    result: Any,
    fmt: str,
    out: TextIO,
    *,
    profile: Any = None,
    eval_profile: Any = None,
    flag_limit: int = 0,
    checkpointing: Any = None,
) -> None:
    """The plan in ``fmt``; in text, with the profile it came from and, with ``checkpointing``
    (``--activation-checkpointing auto``'s outcome), every mode's probe time."""
    if fmt == "json":
        # The notes in the command line's words, as the text output prints them.
        notes = tuple(cli_message(note, note_flags(), bare=False) for note in result.notes)
        data = {"plan": {**result.to_dict(), "notes": list(notes)}}
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
            f"({format_bytes(profile.capacity_bytes)} usable when probed, of "
            f"{format_bytes(profile.total_memory_bytes)})",
            file=out,
        )
        size = profile.max_micro_batch_size
        counts = f"{profile.num_trials} trials, {profile.num_ooms} OOM"
        how = (
            f"maximum {size} predicted from another card's profile, confirmed by one trial at "
            f"{size}: {counts}"
            if profile.confirms_prediction
            else f"measured maximum {size}: {counts}, {profile.method}"
        )
        print(f"recommended      {profile.recommended_micro_batch_size}  ({how})", file=out)
        print_probe_time(
            profile, out, stored=result.source == "cached", checkpointing=checkpointing
        )
        print_limit_note(profile, out, flag_limit=flag_limit)
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
    if result.activation_checkpointing != "none":
        print(f"activation_checkpointing     {result.activation_checkpointing}", file=out)
    print(f"source                       {result.source}", file=out)
    if result.budget is not None:
        print_budget(result.budget, out)
        print_budget_moved(profile, result.budget, out)
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
        print(f"note: {cli_message(note, note_flags(), bare=False)}", file=out)


def input_shapes(shapes: Any) -> str:
    """One sample's shape per input: ``input_ids 512, labels 512``; ``pixels 3x224x224``; inputs
    known only by position (a tuple's ``0``, ``1``) by their kind: ``tensor[32], scalar``."""
    return ", ".join(_input_words(str(k), v) for k, v in shapes.items()) or "-"


def _input_words(name: str, shape: Any) -> str:
    dims = "x".join(map(str, shape))
    if not name.isdigit():  # a named input: its name and shape
        return f"{name} {dims or 'scalar'}"
    return f"tensor[{dims}]" if dims else "scalar"


def reason(option: Any) -> str:
    """Why a world size of the table has no plan, in ``plan``'s flags (``--effective-batch-size
    97 is not a multiple of --world-size 2``)."""
    return cli_message(option.describe(flag_wording), note_flags())


def print_table(options: Sequence[Any], fmt: str, out: TextIO) -> None:
    """A world-size table (:func:`autobatch.planning.plan_table`'s rows) as JSON, or as
    text: one row per world size, its micro-batch sizes, accumulation steps and a note (the time
    per effective batch, a predicted limit, or why no plan)."""
    if fmt == "json":
        rows = [
            {
                "world_size": o.world_size,
                "plan": None if o.plan is None else o.plan.to_dict(),
                "reason": reason(o),
            }
            for o in options
        ]
        print(json.dumps(rows, indent=2), file=out)
        return
    print(f"{'world size':>10}  {'micro-batch':>11}  {'accumulation steps':>18}  note", file=out)
    unequal: tuple[int, ...] = ()
    for option in options:
        if option.plan is None:
            print(
                f"{option.world_size:>10}  {'-':>11}  {'-':>18}  {reason(option)}",
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
        sizes = micro_batch_cell(p.micro_batch_sizes)
        unequal = unequal or (p.micro_batch_sizes if "+" in sizes else ())
        print(
            f"{p.world_size:>10}  {sizes:>11}  {p.gradient_accumulation_steps:>18}  {note}",
            file=out,
        )
    if unequal:
        counts = [(unequal.count(size), size) for size in sorted(set(unequal), reverse=True)]
        print(
            f"micro-batch: one rank's micro-batches per optimizer step; "
            f"{micro_batch_cell(unequal)} is {counts[0][0]} micro-batches of {counts[0][1]} and "
            f"{' and '.join(f'{n} of {size}' for n, size in counts[1:])}, each loss weighted by "
            "its size",
            file=out,
        )


def micro_batch_cell(sizes: Sequence[int]) -> str:
    """A table's micro-batch cell: the one size (``24``), or each size with its count when they
    differ (``2x20+3x19``: 2 micro-batches of 20, 3 of 19), never ``20x19``, which reads as a
    product."""
    distinct = sorted(set(sizes), reverse=True)
    if len(distinct) == 1:
        return str(distinct[0])
    return "+".join(f"{sizes.count(size)}x{size}" for size in distinct)
