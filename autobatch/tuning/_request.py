"""The tuning road's request (:class:`TuneRequest`): one validated object per call of
:func:`autobatch.autotune`, :func:`autobatch.tune` or :func:`autobatch.tuning.autotune_profile`.

The flat keyword functions build it from their arguments; the CLI's ``tune``, the service's probe
jobs and the framework drop-ins build it themselves, and every one of them hands it to
:func:`autobatch.tuning.tune_request` (the plan and the profile) or
:func:`autobatch.tuning.tune_profile` (the profile alone). The fields' docs live here, once.
The plan part is a :class:`~autobatch.planning.PlanRequest` (``plan``), checked when the request
is built; the ranks it plans for are resolved by the road.

Example::

    request = TuneRequest(model=model, sample=sample, effective_batch_size=1024,
                          device="sim:8GiB", safety_margin=0.1)
    tune_request(request).plan.micro_batch_size
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autobatch.device import Device
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning import PlanRequest, Uneven
from autobatch.probing import DEFAULT_LIMIT, LossFn, OnTrial, TrainStep, check_search_arguments
from autobatch.profiles import ProfileStore

__all__ = ["TuneRequest"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TuneRequest:
    """What to tune and how: the step, the device, the probe, the store, the ranks and the plan.

    Checked once, on construction: the probe's ``safety_margin`` and ``max_micro_batch_size``
    (:func:`~autobatch.probing._options.check_search_arguments`, the check :func:`autobatch.probe`
    makes) and, with ``effective_batch_size``, the plan's options (:attr:`plan`). What needs the
    process to check (the model and sample, the device, the ranks) is checked by the road, before
    any step runs.

    Raises:
        ConfigError: a field is out of range or of the wrong kind (names the value and the fix).
    """

    # -- the step ------------------------------------------------------------------------------
    model: torch.nn.Module
    """The model, on the device probed (a DDP or FSDP2 model: every rank probes)."""
    sample: Any
    """One sample or a batch (a tensor, a tuple ``(inputs, targets)``, a dict), a callable
    ``n -> batch``, or a :func:`autobatch.worst_case_sample`; micro-batches are built along
    dim 0."""
    optimizer: torch.optim.Optimizer | None = None
    """The training optimizer; None: an AdamW of the probe's own."""
    loss_fn: LossFn | None = None
    """How an output becomes a loss (see :func:`autobatch.probe`)."""
    train_step: TrainStep | None = None
    """``train_step(model, batch) -> loss``: the step itself, when the sample's form does not
    say it."""
    step_includes_update: bool = False
    """``train_step`` runs backward and the optimizer step itself."""
    amp_dtype: torch.dtype | None = None
    """Autocast the forward and loss in this dtype (``torch.bfloat16``, ``torch.float16``)."""

    # -- the device and the probe --------------------------------------------------------------
    device: str | Device | None = None
    """``"cuda:N"``, ``"cpu"``, ``"sim:SIZE"`` or a Device; None: the model's."""
    gpu_fraction: float | None = None
    """The share of the card this job gets, in (0, 1]; None: the whole card."""
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    """Fraction of the capacity the recommended micro-batch keeps free, in [0, 1)."""
    max_micro_batch_size: int = DEFAULT_LIMIT
    """Largest micro-batch tried (>= 1); with ``effective_batch_size``, no trial is larger than
    ``ceil(effective_batch_size / world_size)`` either."""
    use_estimate: bool = True
    """Start the search from a fake-tensor estimate (False: doubling, then bisection)."""
    on_trial: OnTrial | None = None
    """Called after each real trial (a progress bar, the service's job log)."""
    eval: bool = False
    """Also (:func:`~autobatch.tuning.tune_request`) or only
    (:func:`~autobatch.tuning.tune_profile`) probe the evaluation micro-batch."""

    # -- the store -----------------------------------------------------------------------------
    store: ProfileStore | str | os.PathLike[str] | None = None
    """A ProfileStore or a path; None: ``$AUTOBATCH_STORE`` or the default store."""
    use_store: bool = True
    """False: no read, no write."""
    refresh: bool = False
    """Probe again even when the store has a profile that answers."""
    report_to: str | None = None
    """Base URL of an autobatch service a newly probed profile is registered at."""

    # -- the ranks and the plan ----------------------------------------------------------------
    world_size: int | None = None
    """Data-parallel ranks; None: ``process_group``'s size, else the default process group's,
    else the launcher's ``WORLD_SIZE``, else 1 (:func:`autobatch.autotune`)."""
    data_parallel_size: int | None = None
    """The same as ``world_size`` (give one)."""
    process_group: dist.ProcessGroup | DeviceMesh | None = None
    """The data-parallel ranks' group or mesh dimension; only its size is used."""
    effective_batch_size: int | None = None
    """Samples per optimizer step over all ranks; None: a profile, no plan
    (:func:`~autobatch.tuning.tune_profile`)."""
    multiple_of: int = 1
    """As :attr:`autobatch.planning.PlanRequest.multiple_of`."""
    max_gradient_accumulation_steps: int | None = None
    """As :attr:`autobatch.planning.PlanRequest.max_gradient_accumulation_steps`."""
    uneven: Uneven = "auto"
    """As :attr:`autobatch.planning.PlanRequest.uneven`."""
    allow_inexact: bool = False
    """As :attr:`autobatch.planning.PlanRequest.allow_inexact`."""
    mixed_ranks: bool = False
    """Plan a micro-batch per rank (ranks on cards of different memory or speed): under
    torch.distributed each rank probes its own card alone, the ranks share their limits and
    step lines, and each gets its own plan of the same mixed plan
    (:func:`~autobatch.planning.plan_mixed_ranks`; ``rank_micro_batch_sizes`` lists every
    rank's). False: the ranks agree on the micro-batch that fits on every one. Not with
    ``allow_inexact``."""

    plan: PlanRequest | None = dataclasses.field(init=False, default=None)
    """The plan part, built and checked from the fields above (for one rank until the road
    resolves the ranks); None without ``effective_batch_size``."""

    def __post_init__(self) -> None:
        check_search_arguments(self.max_micro_batch_size, self.safety_margin)
        if self.effective_batch_size is None:
            return
        plan = PlanRequest(
            effective_batch_size=self.effective_batch_size,
            multiple_of=self.multiple_of,
            max_gradient_accumulation_steps=self.max_gradient_accumulation_steps,
            uneven=self.uneven,
            allow_inexact=self.allow_inexact,
        )
        if self.mixed_ranks:
            plan.check_mixed_ranks()
        object.__setattr__(self, "plan", plan)
