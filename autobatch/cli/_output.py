"""What the ``autobatch`` command line prints: plans, tables, budgets, the probe's notes and its
progress, and library remedies worded as this command line's flags (the one place it words them).

Example::

    print_plan(plan, "text", sys.stdout)
    flag_wording(Remedy(parameter="allow_inexact", values=(True,)))   # "--allow-inexact"
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from autobatch.errors import Remedy
from autobatch.integrations import format_config
from autobatch.units import format_bytes

AMP_FLAG_VALUES = {"bfloat16": "bf16", "float16": "fp16"}


FLAGS = {
    "amp_dtype": "--amp",
    "capacity_bytes": "--capacity",
    "device": "--device",
    "gpu_fraction": "--gpu-fraction",
    "input_shape": "--input-shape",
    "image_size": "--image-size",
    "max_micro_batch_size": "--max-micro-batch-size",
    "seq_len": "--seq-len",
    "store": "--store",
    "world_size": "--world-size",
}
"""The library's parameter names whose flag is not the name with dashes (the one table); any
other ``name`` is ``--name`` with ``_`` as ``-`` (``allow_inexact``: ``--allow-inexact``)."""


def flag_value(value: object) -> str:
    """A library value as the flag takes it: ``bf16`` for bfloat16, ``3,224,224`` for a shape."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return AMP_FLAG_VALUES.get(str(value), str(value))


def flag_wording(remedy: Remedy) -> str:
    """A library error's remedy as this command line's flag: ``--allow-inexact``, ``--amp bf16``,
    ``a run without --eval``.

    The one place the CLI words remedies (the library names them by Python argument).
    """
    if not remedy.parameter:
        return remedy.purpose
    flag = FLAGS.get(remedy.parameter, "--" + remedy.parameter.replace("_", "-"))
    # ``is``: 1 == True, and --multiple-of 1 is no switch.
    if len(remedy.values) == 1 and remedy.values[0] is True:
        phrase = flag  # a switch
    elif len(remedy.values) == 1 and remedy.values[0] is False:
        phrase = f"a run without {flag}"  # a switch left off
    else:
        phrase = f"{flag} {' or '.join(map(flag_value, remedy.values))}"
    return f"{phrase} ({remedy.purpose})" if remedy.purpose else phrase


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


def print_probe_time(profile: Any, out: TextIO, *, stored: bool) -> None:
    """The probe's wall time by part; for a profile read from the store, said to be that
    profile's, with its date (no probe ran now)."""
    if profile.timings is None or (stored and not profile.created_at):
        return
    text = profile.timings.describe()
    if stored:
        when = profile.created_at[:16].replace("T", " ")
        text += f"  (the stored profile's, probed {when} UTC; nothing ran now)"
    print(f"probe time       {text}", file=out)


def bytes_or_unknown(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else format_bytes(num_bytes)


def print_budget(budget: Any, out: TextIO) -> None:
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


def print_plan(
    result: Any,
    fmt: str,
    out: TextIO,
    *,
    profile: Any = None,
    eval_profile: Any = None,
    flag_limit: int = 0,
) -> None:
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
        size = profile.max_micro_batch_size
        counts = f"{profile.num_trials} trials, {profile.num_ooms} OOM"
        how = (
            f"predicted from another card's profile, confirmed by one trial at {size}: {counts}"
            if profile.confirms_prediction
            else f"{counts}, {profile.method}"
        )
        print(
            f"max micro-batch  {size}  (recommended {profile.recommended_micro_batch_size}; {how})",
            file=out,
        )
        print_probe_time(profile, out, stored=result.source == "cached")
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


def input_shapes(shapes: Any) -> str:
    """One sample's shape per input: ``input_ids 512, labels 512``; ``pixels 3x224x224``."""
    return ", ".join(f"{k} {'x'.join(map(str, v)) or 'scalar'}" for k, v in shapes.items()) or "-"


class Progress:
    """One tqdm line per probe (to stderr); silent when disabled (``--json``, configs)."""

    def __init__(self, *, enabled: bool) -> None:
        self._enabled = enabled
        self._bar: Any = None

    def trial(self, trial: Any) -> None:
        if not self._enabled:
            return
        if self._bar is None:  # created at the first trial: a cached answer shows no bar
            from tqdm import tqdm

            # The count in words ("1 trial", "3 trials"), not tqdm's "3trial [?trial/s]".
            self._bar = tqdm(
                desc="probing: 0 trials",
                file=sys.stderr,
                leave=True,
                bar_format="{desc} [{elapsed}]",
            )
        outcome = "fits" if trial.fits else ("OOM" if trial.oom else "too big")
        peak = format_bytes(trial.peak_reserved_bytes) if trial.fits else "-"
        self._bar.update(1)
        count = f"{self._bar.n} trial{'' if self._bar.n == 1 else 's'}"
        self._bar.set_description_str(
            f"probing: {count}, micro-batch {trial.micro_batch_size} {outcome}, peak {peak}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def print_table(options: Sequence[Any], fmt: str, out: TextIO) -> None:
    """A world-size table (:func:`autobatch.planning.plan_table`'s rows) as JSON, or as
    text: one row per world size, its micro-batch sizes, accumulation steps and a note (the time
    per effective batch, a predicted limit, or why no plan)."""
    if fmt == "json":
        rows = [
            {
                "world_size": o.world_size,
                "plan": None if o.plan is None else o.plan.to_dict(),
                "reason": o.describe(flag_wording),
            }
            for o in options
        ]
        print(json.dumps(rows, indent=2), file=out)
        return
    print(f"{'world_size':>10}  {'micro_batch':>11}  {'accum_steps':>11}  note", file=out)
    for option in options:
        if option.plan is None:
            print(
                f"{option.world_size:>10}  {'-':>11}  {'-':>11}  {option.describe(flag_wording)}",
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
