"""autobatch: the largest micro-batch that fits, and the accumulation plan that reaches your batch.

Example::

    import autobatch

    plan = autobatch.autotune(model, sample, effective_batch_size=1024, device="cuda:0")
    plan.micro_batch_size, plan.gradient_accumulation_steps

``effective_batch_size = micro_batch_size * gradient_accumulation_steps * world_size``.
"""

from __future__ import annotations

from autobatch.accumulate import Accumulator, SmallMicroBatchNormWarning, StepStats
from autobatch.autotune import autotune
from autobatch.device import Capacity, Device, GpuInfo, MemoryInfo, PeakMemory, resolve_device
from autobatch.device.simulated import SimulatedDevice
from autobatch.distributed import ProcessGroupConsensus
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
from autobatch.estimate import EstimateUnavailableError, estimate
from autobatch.integrations import (
    ConfigFormat,
    deepspeed_config,
    format_config,
    hf_training_arguments,
    lightning_config,
)
from autobatch.planner import Plan, PlanSource, Uneven, WorldSizeOption, plan, plan_world_sizes
from autobatch.probe import Consensus, LocalConsensus, probe
from autobatch.profile import PROFILE_SCHEMA_VERSION, MemoryModel, Profile, Trial
from autobatch.store import ProfileNotFoundError, ProfileStore, default_store_path
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
    "ProcessGroupConsensus",
    "Profile",
    "ProfileNotFoundError",
    "ProfileStore",
    "ServiceError",
    "SimulatedDevice",
    "SmallMicroBatchNormWarning",
    "StepFailedError",
    "StepStats",
    "StoreError",
    "Trial",
    "Uneven",
    "WorldSizeOption",
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
]
