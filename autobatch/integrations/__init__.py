"""Framework integrations: config output for DeepSpeed, Hugging Face and Lightning, and drop-ins.

Each framework's own drop-in lives in its own submodule and imports that framework only there,
so ``import autobatch.integrations`` stays free of torch and of every framework:
``autobatch.integrations.lightning.AutobatchFinder`` (a Callback, ``.[lightning]``),
``autobatch.integrations.hf.autotune_trainer`` (``.[hf]``) and
``autobatch.integrations.accelerate.autotune_accelerator``.

Example::

    from autobatch.integrations import deepspeed_config

    deepspeed_config(plan)  # {"train_micro_batch_size_per_gpu": 16, ...}
"""

from __future__ import annotations

from autobatch.integrations._configs import (
    ConfigFormat,
    deepspeed_config,
    format_config,
    hf_training_arguments,
    lightning_config,
)

__all__ = [
    "ConfigFormat",
    "deepspeed_config",
    "format_config",
    "hf_training_arguments",
    "lightning_config",
]
