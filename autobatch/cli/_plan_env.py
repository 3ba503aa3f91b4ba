"""``autobatch plan --env``: a plan as shell ``export`` lines or a file, for a scheduler's glue.

A Kubernetes init container or a Slurm prolog asks a (central) service for the plan of a model
on a card type or node and hands it to the trainer as environment variables::

    autobatch plan --service http://autobatch-central:8000 --model-fingerprint fp \\
        --card "NVIDIA H100 80GB HBM3" --effective-batch-size 1024 --world-size 8 \\
        --env --output /plan/plan.env
    . /plan/plan.env     # AUTOBATCH_MICRO_BATCH_SIZE=..., AUTOBATCH_PLAN_SOURCE=measured, ...

``--env`` also takes a plan made locally (``--max-micro-batch-size``, ``--profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path
from typing import Any, TextIO

from autobatch.errors import ConfigError
from autobatch.planning import PlanRequest
from autobatch.units import counted

__all__ = ["CENTRAL_URL_ENV_VAR", "env_variables", "remote_plan", "write_plan"]

CENTRAL_URL_ENV_VAR = "AUTOBATCH_CENTRAL_URL"
"""The service ``--service`` defaults to."""


def parse_condition(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` for ``--condition``: the value as JSON when it parses (``8``, ``true``,
    ``{"float32": 4}``), else the text (``bfloat16``)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. amp_dtype=bfloat16)")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def remote_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The service's answer (``PlanPublic`` as JSON) to the plan ``args`` ask for.

    Raises:
        ConfigError: no service URL, or flags the service cannot take together; or the
            service's own 4xx problems (named by field).
        ServiceError: the service is unreachable or failed.
    """
    url = args.service or os.environ.get(CENTRAL_URL_ENV_VAR)
    if not url:
        raise ConfigError(
            f"--model-fingerprint plans from a service's stored profiles: give --service URL "
            f"(or set {CENTRAL_URL_ENV_VAR}), e.g. http://autobatch-central:8000"
        )
    if len(args.world_size) != 1:
        raise ConfigError("a plan from a service takes a single --world-size")
    from autobatch.client import AutobatchClient, PlanQuery  # httpx: only a remote plan needs it

    conditions = dict(args.condition) if args.condition else None
    query = PlanQuery(
        plan=PlanRequest(
            effective_batch_size=args.effective_batch_size,
            world_size=args.world_size[0],
            capacity_bytes=args.capacity,
            multiple_of=args.multiple_of,
            max_gradient_accumulation_steps=args.max_gradient_accumulation_steps,
            uneven=args.uneven,
            allow_inexact=args.allow_inexact,
        ),
        model_fingerprint=args.model_fingerprint,
        card=args.card,
        node=args.node,
        conditions=conditions,
        gpu_fraction=args.gpu_fraction,
    )
    with AutobatchClient(url, token=os.environ.get("AUTOBATCH_API_TOKEN")) as client:
        return client.plan_answer(query)


def env_variables(
    plan: dict[str, Any],
    answer: dict[str, Any] | None = None,
    *,
    measured_max_micro_batch_size: int | None = None,
) -> dict[str, str]:
    """The variables a trainer reads, from a plan's ``to_dict()`` and (from a service) its
    answer.

    ``AUTOBATCH_PLAN_SOURCE`` is the plan's own ``source`` (the JSON's word: ``cached`` for a
    stored profile's real trials, ``measured``, ``estimated``, ``given``), or ``predicted`` when
    either the plan or the profile's selection says so (a profile measured on another card or
    under other conditions, or a limit past its measured sizes); ``AUTOBATCH_PROFILE_MATCH`` is
    the selection's ``match`` (``measured``, ``estimated``, ``predicted``).
    ``AUTOBATCH_RECOMMENDED_MICRO_BATCH_SIZE`` is the largest micro-batch the plan may use (the
    plan's ``max_micro_batch_size``: a profile's measured maximum less the safety margin, or the
    number given); ``AUTOBATCH_MAX_MICRO_BATCH_SIZE`` is its older name, kept as an alias.
    ``AUTOBATCH_MEASURED_MAX_MICRO_BATCH_SIZE`` is the profile's measured maximum (the
    selection's, else ``measured_max_micro_batch_size``), empty when no profile is behind it.
    ``AUTOBATCH_ACTIVATION_CHECKPOINTING`` is the mode the micro-batch was planned under
    (``none``, ``selective``, ``full``): the trainer must train with it, or the micro-batch may
    not fit.
    """
    selection = (answer or {}).get("selection")
    source = plan["source"]
    if selection is not None and selection["match"] == "predicted":
        source = "predicted"
    if selection is not None:
        measured_max_micro_batch_size = selection.get("measured_max_micro_batch_size")
    sizes = plan["micro_batch_sizes"]
    variables = {
        "AUTOBATCH_MICRO_BATCH_SIZE": plan["micro_batch_size"],
        "AUTOBATCH_GRADIENT_ACCUMULATION_STEPS": plan["gradient_accumulation_steps"],
        "AUTOBATCH_EFFECTIVE_BATCH_SIZE": plan["effective_batch_size"],
        "AUTOBATCH_WORLD_SIZE": plan["world_size"],
        "AUTOBATCH_RECOMMENDED_MICRO_BATCH_SIZE": plan["max_micro_batch_size"],
        "AUTOBATCH_MEASURED_MAX_MICRO_BATCH_SIZE": measured_max_micro_batch_size or "",
        "AUTOBATCH_MAX_MICRO_BATCH_SIZE": plan["max_micro_batch_size"],
        "AUTOBATCH_MICRO_BATCH_SIZES": ",".join(str(size) for size in sizes),
        "AUTOBATCH_PLAN_SOURCE": source,
        "AUTOBATCH_PREDICTED_PEAK_MEMORY_BYTES": plan["predicted_peak_memory_bytes"] or "",
        "AUTOBATCH_ACTIVATION_CHECKPOINTING": plan.get("activation_checkpointing") or "none",
    }
    if answer is not None:
        variables["AUTOBATCH_PROFILE_ID"] = answer.get("profile_id") or ""
    if selection is not None:
        variables["AUTOBATCH_PROFILE_MATCH"] = selection["match"]
        variables["AUTOBATCH_PLAN_CARD"] = selection["card"] or ""
        variables["AUTOBATCH_PROFILE_NODE"] = selection["node_name"]
        variables["AUTOBATCH_PROFILE_CARD"] = selection["device_name"]
    return {name: str(value) for name, value in variables.items()}


def write_plan(
    plan: dict[str, Any],
    answer: dict[str, Any] | None,
    output: str | None,
    out: TextIO,
    *,
    measured_max_micro_batch_size: int | None = None,
) -> None:
    """Print the ``export`` lines, or write them (or JSON, for a ``.json`` path) to ``output``
    and say so on ``out``; ``measured_max_micro_batch_size`` is a local profile's (see
    :func:`env_variables`)."""
    variables = env_variables(
        plan, answer, measured_max_micro_batch_size=measured_max_micro_batch_size
    )
    lines = [f"export {name}={shlex.quote(value)}" for name, value in variables.items()]
    if output is None:
        print("\n".join(lines), file=out)
        return
    path = Path(output)
    if path.suffix == ".json":
        data = {"env": variables, "plan": plan, "selection": (answer or {}).get("selection")}
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = "\n".join(lines) + "\n"
    partial = path.with_name(path.name + ".partial")  # a reader never sees half a file
    partial.write_text(text)
    partial.replace(path)
    print(
        f"wrote {path}: micro_batch_size {variables['AUTOBATCH_MICRO_BATCH_SIZE']} x "
        f"{counted(int(variables['AUTOBATCH_GRADIENT_ACCUMULATION_STEPS']), 'step')} x "
        f"{counted(int(variables['AUTOBATCH_WORLD_SIZE']), 'rank')} "
        f"({variables['AUTOBATCH_PLAN_SOURCE']})",
        file=out,
    )
