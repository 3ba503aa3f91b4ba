"""A Plan as the batch settings of DeepSpeed, Hugging Face ``TrainingArguments`` or Lightning.

Imports neither torch nor the frameworks: it only builds dicts (and their JSON). The world size
itself is set by the launcher (``deepspeed --num_gpus``, ``torchrun --nproc-per-node``, Lightning's
``devices`` and ``num_nodes``), and must equal ``plan.world_size``.

Example::

    >>> from autobatch.planning import PlanRequest, plan_request
    >>> p = plan_request(24, PlanRequest(effective_batch_size=64, world_size=2))
    >>> hf_training_arguments(p)
    {'per_device_train_batch_size': 16, 'gradient_accumulation_steps': 2}
    >>> lightning_config(p)["trainer"]
    {'accumulate_grad_batches': 2}

    transformers.TrainingArguments(output_dir="out", **hf_training_arguments(p))
"""

from __future__ import annotations

import json
from typing import Any, Literal

from autobatch.errors import ConfigError, Remedy
from autobatch.planning import Plan

__all__ = [
    "ConfigFormat",
    "deepspeed_config",
    "format_config",
    "hf_training_arguments",
    "lightning_config",
]

ConfigFormat = Literal["json", "deepspeed", "hf", "lightning"]
_FORMATS: tuple[ConfigFormat, ...] = ("json", "deepspeed", "hf", "lightning")


def _require_equal_sizes(plan: Plan, framework: str) -> None:
    if plan.rank_micro_batch_sizes is not None:
        raise ConfigError(
            f"{framework} takes one micro-batch size for every rank and averages the ranks' "
            f"gradients with equal weights, but this is a mixed plan (a micro-batch per rank: "
            f"{list(plan.rank_micro_batch_sizes)}), whose effective batch and gradient it would "
            "get wrong; run the mixed plan with autobatch's Accumulator and MixedBatchSampler "
            "(autobatch.training), or plan without mixed_ranks (every rank at the smallest "
            "card's micro-batch)"
        )
    if plan.micro_batch_sizes[0] != plan.micro_batch_sizes[-1]:
        raise ConfigError(
            f"{framework} takes one micro-batch size, but this plan has unequal micro-batches "
            f"({plan.micro_batch_sizes[0]} and {plan.micro_batch_sizes[-1]})",
            remedies=[
                Remedy(
                    parameter="uneven",
                    values=("never",),
                    purpose="equal sizes, maybe more accumulation steps",
                ),
                Remedy(
                    purpose="autobatch's Accumulator in the loop, which weights losses by "
                    "micro-batch size"
                ),
            ],
        )


DEFAULT_EVERY = 2
"""``"selective"`` checkpoints every 2nd block (``autobatch.probing._checkpointing``'s default;
this module imports no torch, so the number is repeated here and a test keeps them equal)."""

DEEPSPEED_CHECKPOINTING = {
    "partition_activations": False,
    "cpu_checkpointing": False,
    "contiguous_memory_optimization": False,
    "number_checkpoints": None,
    "synchronize_checkpoint_boundary": False,
    "profile": False,
}
"""DeepSpeed's ``activation_checkpointing`` section at its documented defaults: it configures
``deepspeed.checkpointing.checkpoint`` (the function a Megatron-style model calls per block);
it switches nothing on by itself, so a model that does not call it is checkpointed with
:func:`autobatch.probing.apply_activation_checkpointing` (or Hugging Face's
``gradient_checkpointing_enable()``) before ``deepspeed.initialize``."""


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """The batch keys of a DeepSpeed config (merge them into yours).

    DeepSpeed checks ``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * world_size`` each time it reads a config, and it reads it
    before its process group exists too (ZeRO-3's ``zero.Init`` inside ``from_pretrained``
    under ``HfDeepSpeedConfig``), with a world size of 1. So ``train_batch_size`` is left out:
    DeepSpeed then sets it to ``m * k * world_size`` itself, which passes that check before the
    group exists and after, and equals ``plan.effective_batch_size`` once launched on
    ``plan.world_size`` ranks (as the launcher must: ``deepspeed --num_gpus``).

    Args:
        plan: a plan with equal micro-batch sizes.

    Returns:
        ``{"train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": k}``, and with
        a plan that checkpoints activations the ``"activation_checkpointing"`` section
        (:data:`DEEPSPEED_CHECKPOINTING`).

    Raises:
        ConfigError: the plan's micro-batches are of unequal size, or it is a mixed plan (a
            micro-batch per rank), which the framework cannot run.
    """
    _require_equal_sizes(plan, "DeepSpeed")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
    }
    if plan.activation_checkpointing != "none":
        config["activation_checkpointing"] = dict(DEEPSPEED_CHECKPOINTING)
    return config


def hf_training_arguments(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` (or its command-line flags).

    Args:
        plan: a plan with equal micro-batch sizes.

    Returns:
        ``{"per_device_train_batch_size": m, "gradient_accumulation_steps": k}``, and
        ``"per_device_eval_batch_size"`` when the plan knows its ``eval_micro_batch_size``
        (``autotune(..., eval=True)``); with a plan that checkpoints activations,
        ``"activation_checkpointing": True`` and ``"activation_checkpointing_kwargs":
        {"every_n_layers": n, "use_reentrant": False}`` (transformers 5's switch, which
        checkpoints layers ``0, n, 2n...`` as :mod:`autobatch.probing._checkpointing` does: n is
        1 for ``"full"``, 2 for ``"selective"``; transformers 4 names it
        ``gradient_checkpointing``, now a deprecated alias, without ``every_n_layers``).

    Raises:
        ConfigError: the plan's micro-batches are of unequal size, or it is a mixed plan (a
            micro-batch per rank), which the framework cannot run.
    """
    _require_equal_sizes(plan, "Hugging Face TrainingArguments")
    arguments: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
    }
    if plan.eval_micro_batch_size is not None:
        arguments["per_device_eval_batch_size"] = plan.eval_micro_batch_size
    if plan.activation_checkpointing != "none":
        every = 1 if plan.activation_checkpointing == "full" else DEFAULT_EVERY
        arguments["activation_checkpointing"] = True
        arguments["activation_checkpointing_kwargs"] = {
            "every_n_layers": every,
            "use_reentrant": False,
        }
    return arguments


def lightning_config(plan: Plan) -> dict[str, dict[str, Any]]:
    """Lightning settings: the ``Trainer``'s and the training ``DataLoader``'s arguments.

    Args:
        plan: a plan with equal micro-batch sizes.

    Returns:
        ``{"trainer": {"accumulate_grad_batches": k}, "dataloader": {"batch_size": m}}``
        (``batch_size`` is the DataLoader's own name for the micro-batch size); with a plan
        that checkpoints activations, ``"model": {"activation_checkpointing": mode}``: the
        LightningModule applies it in ``configure_model`` with
        ``autobatch.probing.apply_activation_checkpointing(self, mode)`` (Lightning has no
        Trainer switch for it outside ``FSDPStrategy(activation_checkpointing_policy=...)``).

    Raises:
        ConfigError: the plan's micro-batches are of unequal size, or it is a mixed plan (a
            micro-batch per rank), which the framework cannot run.
    """
    _require_equal_sizes(plan, "Lightning")
    config: dict[str, dict[str, Any]] = {
        "trainer": {"accumulate_grad_batches": plan.gradient_accumulation_steps},
        "dataloader": {"batch_size": plan.micro_batch_size},
    }
    if plan.activation_checkpointing != "none":
        config["model"] = {"activation_checkpointing": plan.activation_checkpointing}
    return config


def format_config(plan: Plan, fmt: ConfigFormat) -> str:
    """The plan as JSON text: the whole plan, or one framework's settings.

    Args:
        plan: the plan to format.
        fmt: ``"json"`` (the whole :meth:`Plan.to_dict`), ``"deepspeed"``, ``"hf"`` or
            ``"lightning"`` (the dicts of the functions above).

    Returns:
        Indented JSON with sorted keys, without a trailing newline.

    Raises:
        ConfigError: ``fmt`` is unknown, or a framework format is asked for a plan with unequal
            micro-batch sizes or for a mixed plan.
    """
    data: dict[str, Any]
    if fmt == "json":
        data = plan.to_dict()
    elif fmt == "deepspeed":
        data = deepspeed_config(plan)
    elif fmt == "hf":
        data = hf_training_arguments(plan)
    elif fmt == "lightning":
        data = lightning_config(plan)
    else:
        raise ConfigError(f"config format {fmt!r} must be one of {list(_FORMATS)}")
    return json.dumps(data, indent=2, sort_keys=True)
