"""The tuning road's request (:class:`TuneRequest`): one object per tuning, nested as the concept
is, built once with the truth by :meth:`TuneRequest.build` and passed whole down the road.

- what to run: :attr:`TuneRequest.step` (a :class:`~autobatch.probing.StepSpec`);
- how to probe: :attr:`TuneRequest.probe` (a :class:`~autobatch.probing.ProbeOptions`: the
  device, the margin, the search cap, the live conditions);
- where profiles live: :attr:`TuneRequest.store` (a :class:`StoreOptions`);
- what to plan: :attr:`TuneRequest.plan` (a :class:`~autobatch.planning.PlanRequest` whose
  ``world_size`` is the data-parallel size resolved when the request is built).

The keyword options of :func:`autobatch.autotune`, :func:`autobatch.tune` and
:func:`autobatch.tuning.autotune_profile` are declared once, with their docs, in
:class:`TuneOptions` and :class:`ProfileOptions`; :meth:`TuneRequest.build` takes them (a test
keeps the declaration and the builder's keywords equal). The CLI's ``tune``, the service's probe
jobs and the framework drop-ins call the same builder.

Example::

    request = TuneRequest.build(model, sample, effective_batch_size=1024,
                                device="sim:8GiB", safety_margin=0.1)
    request.plan.world_size, request.probe.safety_margin
    tune_request(request).plan.micro_batch_size
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypedDict, Unpack

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autobatch.conditions import one_world_size
from autobatch.device import Device, resolve_device
from autobatch.distributed import LocalConsensus, process_group_consensus, resolve_world_size
from autobatch.extras import keeping_rng
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning import PlanRequest, Uneven
from autobatch.probing import (
    DEFAULT_SEARCH_LIMIT,
    LossFn,
    OnStage,
    OnTrial,
    ProbeOptions,
    StepSpec,
    TrainStep,
    model_device,
)
from autobatch.store import ProfileRemote, ProfileStore
from autobatch.tuning._cache import StoreOptions
from autobatch.tuning._checkpointing import CheckpointingRequest

__all__ = ["BuildOptions", "ProfileOptions", "TuneOptions", "TuneRequest", "accept_options"]


class _StepProbeStore(TypedDict, total=False):
    """The options every tuning takes: the step, the probe, the store."""

    # -- what to run ---------------------------------------------------------------------------
    optimizer: torch.optim.Optimizer | None
    """The training optimizer; None (default): an AdamW of the probe's own."""
    loss_fn: LossFn | None
    """How an output becomes a loss (see :func:`autobatch.probe`)."""
    train_step: TrainStep | None
    """``train_step(model, batch) -> loss``: the step itself, when the sample's form does not
    say it."""
    step_includes_update: bool
    """``train_step`` runs backward and the optimizer step itself (default False)."""
    amp_dtype: torch.dtype | None
    """Autocast the forward and loss in this dtype (``torch.bfloat16``, ``torch.float16``)."""
    model_name: str | None
    """How listings name the model (``autobatch profiles list``, ``GET /v1/profiles``); None
    (default): its class name (``GPT2LMHeadModel``). Not part of what a profile answers for."""

    # -- how to probe --------------------------------------------------------------------------
    device: str | Device | None
    """``"cuda:N"``, ``"cpu"``, ``"sim:SIZE"`` or a Device; None (default): the model's."""
    gpu_fraction: float | None
    """The share of the card this job gets, in (0, 1]; None (default): the whole card."""
    safety_margin: float
    """Fraction of the capacity the recommended micro-batch keeps free, in [0, 1) (default
    :data:`autobatch.margin.DEFAULT_SAFETY_MARGIN`, 0.05)."""
    max_micro_batch_size: int
    """The search cap: the largest micro-batch tried (>= 1, default 65,536); with
    ``effective_batch_size``, no trial is larger than ``ceil(effective_batch_size /
    world_size)`` either, the largest micro-batch a plan for the request can use."""
    on_trial: OnTrial | None
    """Called after each real trial (a progress bar, the service's job log)."""
    on_stage: OnStage | None
    """Called as each stage of a probe starts (warm-up, estimate, trials, confirm), with the
    most real trials the probe takes (:class:`autobatch.probing.ProbeStage`): a progress
    display's stage and what is left."""
    eval: bool
    """With ``effective_batch_size``: also probe the evaluation micro-batch (forward under
    inference_mode, cached apart from the training profile; the plan's
    ``eval_micro_batch_size`` is its recommended size). Without: probe the evaluation
    micro-batch only (:func:`autobatch.probe`'s ``eval``). Default False."""

    # -- where profiles live -------------------------------------------------------------------
    store: ProfileStore | str | os.PathLike[str] | None
    """A ProfileStore (left open) or a path; None (default): ``$AUTOBATCH_STORE`` or
    ``~/.cache/autobatch/profiles.sqlite3``."""
    use_store: bool
    """False: no read, no write (default True)."""
    refresh: bool
    """Probe again even when the store has a profile that answers (default False)."""
    report_to: str | None
    """Base URL of an autobatch service the profile is registered at, a newly probed one or the
    stored one that answered (idempotent: one the service holds is not stored twice; ``POST
    /v1/profiles``, bearer token from ``AUTOBATCH_API_TOKEN``); under torch.distributed only
    rank 0 reports; a failure warns (:class:`~autobatch.errors.ReportWarning`)."""


class ProfileOptions(_StepProbeStore, total=False):
    """The keyword options of :func:`autobatch.tuning.autotune_profile` (a profile, no plan)."""

    use_estimate: bool
    """Start the search from a fake-tensor estimate (default True; False: doubling, then
    bisection)."""


class TuneOptions(_StepProbeStore, total=False):
    """The keyword options of :func:`autobatch.autotune` and :func:`autobatch.tune` besides
    ``effective_batch_size`` (samples per optimizer step over all ranks, > 0)."""

    # -- what to plan --------------------------------------------------------------------------
    world_size: int | None
    """Data-parallel ranks; None (default): the size of ``process_group`` when given, else the
    default process group's under an initialised torch.distributed (refused when the model's
    parameters are on a DeviceMesh with tensor-parallel ranks: say which ranks are
    data-parallel), else the launcher's (torchrun's ``WORLD_SIZE``, Slurm's...), else 1. Under
    torch.distributed the plan's notes end with ``E = m x k x dp`` in words."""
    data_parallel_size: int | None
    """An accepted alias of ``world_size`` (give one; both given must agree:
    :func:`autobatch.conditions.one_world_size`)."""
    process_group: dist.ProcessGroup | DeviceMesh | None
    """The data-parallel ranks' process group, or that dimension of a DeviceMesh
    (``mesh["dp"]``); only its size is used. The ranks probing together are always the whole
    default group (a micro-batch must fit on every rank)."""
    multiple_of: int
    """Every micro-batch a multiple of this (default 1); see :func:`autobatch.plan`."""
    max_gradient_accumulation_steps: int | None
    """The most accumulation steps (default None: no bound); see :func:`autobatch.plan`."""
    uneven: Uneven
    """Micro-batches of unequal sizes: ``"auto"`` (default), ``"never"``, ``"always"``; see
    :func:`autobatch.plan`."""
    allow_inexact: bool
    """Reach the nearest effective batch size (default False); see :func:`autobatch.plan`."""
    activation_checkpointing: str
    """Activation checkpointing of the model's repeated blocks: ``"none"`` (default: the model
    as given, nothing imposed), ``"selective"`` (every 2nd block), ``"full"`` (every block), or
    ``"auto"``: probe the modes by real trials and plan with the one reaching the effective
    batch in the least time per optimizer step (the plan's ``activation_checkpointing``; apply
    it with :func:`autobatch.probing.apply_activation_checkpointing`). See
    :mod:`autobatch.tuning._checkpointing`."""
    checkpoint_block_class: type[torch.nn.Module] | str | None
    """The class (or class name) of the blocks to checkpoint; None (default): the items of
    every outermost ``nn.ModuleList`` of 2 or more layers, of one class or mixed (a
    transformers model's layers; a hybrid stack; an encoder-decoder's both stacks; never a
    list of single Linears). A class that matches no module is a ConfigError
    whatever the mode."""
    mixed_ranks: bool
    """Ranks on cards of different memory or speed (default False): under torch.distributed
    each rank probes its own card alone, the ranks share their limits and step times, and each
    returns its own plan of one mixed plan (:func:`autobatch.planning.plan_mixed_ranks`):
    ``micro_batch_size`` its own, ``rank_micro_batch_sizes`` every rank's, one
    ``gradient_accumulation_steps``. Feed each rank its share of every global batch
    (:class:`autobatch.training.MixedBatchSampler`). Not with ``allow_inexact``;
    ``world_size`` must be the default group's. False: the ranks agree on the micro-batch that
    fits on every one."""


class BuildOptions(TuneOptions, ProfileOptions, total=False):
    """Every option :meth:`TuneRequest.build` takes besides ``effective_batch_size``: the
    union of :class:`TuneOptions` and :class:`ProfileOptions`."""


_DEFAULTS: dict[str, Any] = {
    "step_includes_update": False,
    "safety_margin": DEFAULT_SAFETY_MARGIN,
    "max_micro_batch_size": DEFAULT_SEARCH_LIMIT,
    "use_estimate": True,
    "eval": False,
    "multiple_of": 1,
    "uneven": "auto",
    "allow_inexact": False,
    "mixed_ranks": False,
    "activation_checkpointing": "none",
    "use_store": True,
    "refresh": False,
}
"""The defaults of the options that have one besides None, in one place (the declarations
above document each)."""


def accept_options(caller: str, options: Mapping[str, Any], declared: type) -> None:
    """Refuse a keyword ``declared`` (a :class:`TuneOptions` or :class:`ProfileOptions`) does
    not hold, in Python's own words for ``caller``.

    Raises:
        TypeError: ``caller() got an unexpected keyword argument 'name'``.
    """
    for name in options:
        if name not in declared.__annotations__:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TuneRequest:
    """One tuning: what to run, how to probe, where profiles live, what to plan. Build it with
    :meth:`build`, which checks every option once and resolves what the process decides (the
    device, the data-parallel size, the live conditions) before any step runs."""

    step: StepSpec
    """What to run: the model, its micro-batches, how a batch becomes a training step."""
    probe: ProbeOptions
    """How to probe: the device, the safety margin, the search cap (as given), the ranks'
    consensus and the live conditions (with the data-parallel size the plan is for)."""
    store: StoreOptions
    """Where profiles come from and go to."""
    plan: PlanRequest | None
    """What to plan, for the resolved data-parallel size; None without
    ``effective_batch_size`` (a profile, no plan: :func:`~autobatch.tuning.tune_profile`)."""
    eval: bool = False
    """With a plan: also probe the evaluation micro-batch (``probe`` is the training one)."""
    mixed_ranks: bool = False
    """A micro-batch per rank (``probe`` then runs this rank's card alone)."""
    checkpointing: CheckpointingRequest = CheckpointingRequest()
    """The activation checkpointing asked for (``"none"``: the model as given)."""

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        sample: Any,
        *,
        effective_batch_size: int | None = None,
        **options: Unpack[BuildOptions],
    ) -> TuneRequest:
        """The request of ``model`` and ``sample`` (one sample or a batch, a callable
        ``n -> batch``, or a :func:`autobatch.worst_case_sample`) with these options (documented
        once, in :class:`TuneOptions` and :class:`ProfileOptions`), checked once: the step
        (:meth:`StepSpec.build`), the device, the probe's margin and search cap
        (:meth:`ProbeOptions.build`), and with ``effective_batch_size`` the data-parallel size
        (:func:`autobatch.distributed.resolve_world_size`: the arguments, the process group,
        the launcher's environment, read once) and the plan's options (:class:`PlanRequest`).
        Under torch.distributed every rank builds its request.

        Raises:
            ConfigError: an option out of range or of the wrong kind, sources of the
                data-parallel size that disagree, a model or sample the probe cannot run
                (names the value and the fix).
            DeviceUnavailableError: ``device`` cannot be opened.
        """
        accept_options("TuneRequest.build", options, BuildOptions)
        option: dict[str, Any] = {**_DEFAULTS, **options}
        step = StepSpec.build(
            model,
            sample,
            optimizer=options.get("optimizer"),
            loss_fn=options.get("loss_fn"),
            train_step=options.get("train_step"),
            step_includes_update=option["step_includes_update"],
            amp_dtype=options.get("amp_dtype"),
            model_name=options.get("model_name"),
        )
        target = resolve_device(
            options.get("device"),
            default=model_device(model),
            gpu_fraction=options.get("gpu_fraction"),
        )
        mixed_ranks = option["mixed_ranks"]
        eval = option["eval"]
        planned: PlanRequest | None = None
        sourced_world_size: tuple[int, str] | None = None
        if effective_batch_size is not None:
            sourced_world_size = resolve_world_size(
                model,
                world_size=one_world_size(
                    options.get("world_size"), options.get("data_parallel_size")
                ),
                process_group=options.get("process_group"),
            )
            planned = PlanRequest(
                effective_batch_size=effective_batch_size,
                world_size=sourced_world_size[0],
                multiple_of=option["multiple_of"],
                max_gradient_accumulation_steps=options.get("max_gradient_accumulation_steps"),
                uneven=option["uneven"],
                allow_inexact=option["allow_inexact"],
            )
            if mixed_ranks:
                planned.check_mixed_ranks()
        probe = ProbeOptions.build(
            step,
            device=target,
            # A mixed plan's ranks each probe their own card alone; otherwise the ranks agree.
            consensus=LocalConsensus()
            if mixed_ranks
            else process_group_consensus(target.torch_device),
            safety_margin=option["safety_margin"],
            search_limit=option["max_micro_batch_size"],  # the public keyword: the search cap
            use_estimate=option["use_estimate"],
            on_trial=options.get("on_trial"),
            eval=eval and planned is None,  # with a plan, the evaluation is probed after it
            sourced_world_size=sourced_world_size,
        )
        probe = dataclasses.replace(probe, on_stage=options.get("on_stage"))
        storing = StoreOptions(
            store=options.get("store"),
            use_store=option["use_store"],
            refresh=option["refresh"],
            remote=_remote(options.get("report_to")),
        )
        return cls(
            step=step,
            probe=probe,
            store=storing,
            plan=planned,
            eval=eval and planned is not None,
            mixed_ranks=mixed_ranks,
            checkpointing=CheckpointingRequest.build(
                model, option["activation_checkpointing"], options.get("checkpoint_block_class")
            ),
        )


def _remote(report_to: str | None) -> ProfileRemote | None:
    """The service at ``report_to`` (:func:`autobatch.client.service_remote`); None without a
    URL. The client (httpx, which imports rich) is imported only when a remote is named: an
    import may draw from ``random`` and the tuning road leaves the RNG states as they were."""
    if report_to is None:
        return None
    with keeping_rng():
        from autobatch.client import service_remote

    return service_remote(report_to)
