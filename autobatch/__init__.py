"""autobatch: the largest micro-batch that fits, and the accumulation plan that reaches your batch.

Example::

    import autobatch

    plan = autobatch.autotune(model, sample, effective_batch_size=1024, device="cuda:0")
    plan.micro_batch_size, plan.gradient_accumulation_steps

``effective_batch_size = micro_batch_size * gradient_accumulation_steps * world_size``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autobatch.device import Capacity, Device, GpuInfo, MemoryInfo, PeakMemory, resolve_device
    from autobatch.device.simulated import SimulatedDevice
    from autobatch.distributed.consensus import ProcessGroupConsensus
    from autobatch.errors import (
        AutobatchError,
        ConfigError,
        DeviceUnavailableError,
        DistributedError,
        DoesNotFitError,
        NoFeasiblePlanError,
        ServiceError,
        StepFailedError,
        StoreError,
    )
    from autobatch.integrations.configs import (
        ConfigFormat,
        deepspeed_config,
        format_config,
        hf_training_arguments,
        lightning_config,
    )
    from autobatch.planning.planner import (
        Plan,
        PlanSource,
        Uneven,
        WorldSizeOption,
        plan,
        plan_world_sizes,
    )
    from autobatch.planning.prediction import Prediction
    from autobatch.probing.estimate import EstimateUnavailableError, estimate
    from autobatch.probing.probe import Consensus, LocalConsensus, probe
    from autobatch.probing.worst_case import WorstCaseSample, worst_case_sample
    from autobatch.profile import PROFILE_SCHEMA_VERSION, MemoryModel, Profile, StepIdentity, Trial
    from autobatch.profiles.store import ProfileNotFoundError, ProfileStore, default_store_path
    from autobatch.training.accumulator import Accumulator, SmallMicroBatchNormWarning, StepStats
    from autobatch.training.oom_split import SplitEvent
    from autobatch.tuning import ReportWarning, Tuning, autotune, tune
    from autobatch.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "AutobatchError",
    "Capacity",
    "ConfigError",
    "ConfigFormat",
    "Consensus",
    "Device",
    "DeviceUnavailableError",
    "DistributedError",
    "DoesNotFitError",
    "EstimateUnavailableError",
    "GpuInfo",
    "LocalConsensus",
    "MemoryInfo",
    "MemoryModel",
    "NoFeasiblePlanError",
    "PROFILE_SCHEMA_VERSION",
    "PeakMemory",
    "Plan",
    "PlanSource",
    "Prediction",
    "ProcessGroupConsensus",
    "Profile",
    "ProfileNotFoundError",
    "ProfileStore",
    "ReportWarning",
    "ServiceError",
    "SimulatedDevice",
    "SmallMicroBatchNormWarning",
    "SplitEvent",
    "StepFailedError",
    "StepIdentity",
    "StepStats",
    "StoreError",
    "Trial",
    "Tuning",
    "Uneven",
    "WorldSizeOption",
    "WorstCaseSample",
    "autotune",
    "deepspeed_config",
    "default_store_path",
    "estimate",
    "format_bytes",
    "format_config",
    "hf_training_arguments",
    "lightning_config",
    "parse_bytes",
    "plan",
    "plan_world_sizes",
    "probe",
    "resolve_device",
    "tune",
    "worst_case_sample",
]

# Names are imported on first use (PEP 562), so the torch-free parts (planner, profile, store,
# integrations, client) import without torch: the HTTP service never loads it, and a scheduler
# can plan without it installed.
_EXPORTS: dict[str, str] = {
    "Accumulator": "autobatch.training.accumulator",
    "SmallMicroBatchNormWarning": "autobatch.training.accumulator",
    "StepStats": "autobatch.training.accumulator",
    "ReportWarning": "autobatch.tuning",
    "Tuning": "autobatch.tuning",
    "autotune": "autobatch.tuning",
    "tune": "autobatch.tuning",
    "Capacity": "autobatch.device",
    "Device": "autobatch.device",
    "GpuInfo": "autobatch.device",
    "MemoryInfo": "autobatch.device",
    "PeakMemory": "autobatch.device",
    "resolve_device": "autobatch.device",
    "SimulatedDevice": "autobatch.device.simulated",
    "ProcessGroupConsensus": "autobatch.distributed.consensus",
    "AutobatchError": "autobatch.errors",
    "ConfigError": "autobatch.errors",
    "DeviceUnavailableError": "autobatch.errors",
    "DistributedError": "autobatch.errors",
    "DoesNotFitError": "autobatch.errors",
    "NoFeasiblePlanError": "autobatch.errors",
    "ServiceError": "autobatch.errors",
    "StepFailedError": "autobatch.errors",
    "StoreError": "autobatch.errors",
    "EstimateUnavailableError": "autobatch.probing.estimate",
    "estimate": "autobatch.probing.estimate",
    "ConfigFormat": "autobatch.integrations.configs",
    "deepspeed_config": "autobatch.integrations.configs",
    "format_config": "autobatch.integrations.configs",
    "hf_training_arguments": "autobatch.integrations.configs",
    "lightning_config": "autobatch.integrations.configs",
    "Prediction": "autobatch.planning.prediction",
    "Plan": "autobatch.planning.planner",
    "PlanSource": "autobatch.planning.planner",
    "Uneven": "autobatch.planning.planner",
    "WorldSizeOption": "autobatch.planning.planner",
    "plan": "autobatch.planning.planner",
    "plan_world_sizes": "autobatch.planning.planner",
    "Consensus": "autobatch.probing.probe",
    "LocalConsensus": "autobatch.probing.probe",
    "probe": "autobatch.probing.probe",
    "MemoryModel": "autobatch.profile",
    "PROFILE_SCHEMA_VERSION": "autobatch.profile",
    "Profile": "autobatch.profile",
    "StepIdentity": "autobatch.profile",
    "Trial": "autobatch.profile",
    "ProfileNotFoundError": "autobatch.profiles.store",
    "ProfileStore": "autobatch.profiles.store",
    "default_store_path": "autobatch.profiles.store",
    "SplitEvent": "autobatch.training.oom_split",
    "format_bytes": "autobatch.units",
    "parse_bytes": "autobatch.units",
    "WorstCaseSample": "autobatch.probing.worst_case",
    "worst_case_sample": "autobatch.probing.worst_case",
}


if not TYPE_CHECKING:  # to type checkers, the package has exactly the names imported above

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if (
            module is None
        ):  # a submodule, as ``autobatch.planning.planner`` was before exports were lazy
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module 'autobatch' has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
