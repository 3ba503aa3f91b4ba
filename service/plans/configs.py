"""The frameworks' settings for a plan, as ``POST /v1/plan`` answers them (``PlanConfigs``).

Example::

    plan_configs(plan)["deepspeed"]   # {"train_micro_batch_size_per_gpu": 16, ...}
"""

from __future__ import annotations

from typing import Any

from autobatch.errors import ConfigError
from autobatch.integrations import deepspeed_config, hf_training_arguments, lightning_config
from autobatch.planning import Plan
from service.web.wording import describe

__all__ = ["plan_configs"]


def plan_configs(result: Plan) -> dict[str, Any]:
    """``PlanConfigs``: the frameworks' settings, or nulls and the reason they cannot be given."""
    try:
        return {
            "deepspeed": deepspeed_config(result),
            "hf_training_arguments": hf_training_arguments(result),
            "lightning": lightning_config(result),
            "reason": None,
        }
    except ConfigError as exc:
        return {
            "deepspeed": None,
            "hf_training_arguments": None,
            "lightning": None,
            "reason": describe(exc),
        }
