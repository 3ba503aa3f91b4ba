"""autobatch: the largest micro-batch that fits, and the accumulation plan that reaches your batch.

Example::

    import autobatch

    plan = autobatch.autotune(model, sample, effective_batch_size=1024, device="cuda:0")
    plan.micro_batch_size, plan.gradient_accumulation_steps

``effective_batch_size = micro_batch_size * gradient_accumulation_steps * world_size``.

The public surface is ``__all__`` below: what users call or catch. Beside it, documented
namespaces: :mod:`autobatch.errors` (every error and warning), :mod:`autobatch.conditions` (what a
plan holds under), :mod:`autobatch.integrations` (framework configs and drop-ins),
:mod:`autobatch.client` (the HTTP client), and each layer's
face (:mod:`autobatch.device`, :mod:`autobatch.planning`, :mod:`autobatch.store`, ...) for
code that builds on a layer, as the service and the benchmarks do. Modules inside a layer are
private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autobatch.extras import keeping_rng

if TYPE_CHECKING:
    from autobatch.device import SimulatedDevice, resolve_device
    from autobatch.distributed import ProcessGroupConsensus
    from autobatch.errors import (
        AutobatchError,
        ConfigError,
        DeviceUnavailableError,
        DistributedError,
        DoesNotFitError,
        EstimateUnavailableError,
        NoFeasiblePlanError,
        ServiceError,
        StepFailedError,
        StoreError,
    )
    from autobatch.live import plan, plan_world_sizes
    from autobatch.planning import Plan, PlanRequest
    from autobatch.probing import estimate, probe, worst_case_sample
    from autobatch.profile import Profile
    from autobatch.store import ProfileStore
    from autobatch.training import Accumulator, SplitEvent
    from autobatch.tuning import TuneRequest, autotune, split_recorder, tune
    from autobatch.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "AutobatchError",
    "ConfigError",
    "DeviceUnavailableError",
    "DistributedError",
    "DoesNotFitError",
    "EstimateUnavailableError",
    "NoFeasiblePlanError",
    "Plan",
    "PlanRequest",
    "ProcessGroupConsensus",
    "Profile",
    "ProfileStore",
    "ServiceError",
    "SimulatedDevice",
    "SplitEvent",
    "StepFailedError",
    "StoreError",
    "TuneRequest",
    "autotune",
    "estimate",
    "format_bytes",
    "parse_bytes",
    "plan",
    "plan_world_sizes",
    "probe",
    "resolve_device",
    "split_recorder",
    "tune",
    "worst_case_sample",
]

# Names are imported on first use (PEP 562), so the torch-free parts (planner, profile, store,
# integrations, client) import without torch: the HTTP service never loads it, and a scheduler
# can plan without it installed.
_EXPORTS: dict[str, str] = {
    "Accumulator": "autobatch.training",
    "SplitEvent": "autobatch.training",
    "autotune": "autobatch.tuning",
    "split_recorder": "autobatch.tuning",
    "tune": "autobatch.tuning",
    "resolve_device": "autobatch.device",
    "SimulatedDevice": "autobatch.device",
    "ProcessGroupConsensus": "autobatch.distributed",
    "AutobatchError": "autobatch.errors",
    "ConfigError": "autobatch.errors",
    "DeviceUnavailableError": "autobatch.errors",
    "DistributedError": "autobatch.errors",
    "DoesNotFitError": "autobatch.errors",
    "EstimateUnavailableError": "autobatch.errors",
    "NoFeasiblePlanError": "autobatch.errors",
    "ServiceError": "autobatch.errors",
    "StepFailedError": "autobatch.errors",
    "StoreError": "autobatch.errors",
    "Plan": "autobatch.planning",
    "PlanRequest": "autobatch.planning",
    "TuneRequest": "autobatch.tuning",
    "plan": "autobatch.live",
    "plan_world_sizes": "autobatch.live",
    "estimate": "autobatch.probing",
    "probe": "autobatch.probing",
    "worst_case_sample": "autobatch.probing",
    "Profile": "autobatch.profile",
    "ProfileStore": "autobatch.store",
    "format_bytes": "autobatch.units",
    "parse_bytes": "autobatch.units",
}


if not TYPE_CHECKING:  # to type checkers, the package has exactly the names imported above

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(
                f"module 'autobatch' has no attribute {name!r}; the public names are "
                "autobatch.__all__ (errors in autobatch.errors, framework configs in "
                "autobatch.integrations)"
            )
        with keeping_rng():  # a module imported on first use must not draw from `random`
            value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
