"""What an Accumulator checks when it is built: that it can drive the model's data parallelism
and the optimizer it is given, that ``on_oom="split"`` can run pieces on one rank, and that a
plan it is given was made for this loop (its world size, its accumulation steps, and the
gradient-sync mode its profile was measured in).

Example::

    parallel = loop_parallelism(model, optimizer, on_oom="raise")   # None: one process
    steps = check_plan(plan, gradient_accumulation_steps=None, parallel=parallel)
"""

from __future__ import annotations

from autobatch.distributed import DataParallel, data_parallel, refuse_engine
from autobatch.errors import ConfigError
from autobatch.planning import Plan

__all__ = ["check_plan", "loop_parallelism"]


def loop_parallelism(model: object, optimizer: object, *, on_oom: str) -> DataParallel | None:
    """The model's data-parallel gradient reduction the Accumulator drives (None: none).

    Raises:
        ConfigError: the model or the optimizer is an engine that owns accumulation
            (DeepSpeed's), the model is sharded with FSDP1 or over a mesh the Accumulator
            cannot tell the data-parallel ranks of, or ``on_oom="split"`` with FSDP2 (whose
            forward all-gathers from every rank: a piece on one rank would leave the others in
            it).
    """
    import torch

    refuse_engine(optimizer, "optimizer")
    assert isinstance(model, torch.nn.Module)
    parallel = data_parallel(model)
    if parallel is not None and on_oom == "split" and parallel.ddp is None:
        raise ConfigError(
            f"on_oom='split' runs the pieces of a split micro-batch on one rank only, but a "
            f"{parallel.wrapper} model all-gathers its parameters from every rank in each "
            "forward pass, which the other ranks would not join (they would wait until the "
            "process group's timeout); use on_oom='raise', and probe with the worst-case "
            "batch (autobatch.worst_case_sample) so that none runs out of memory"
        )
    return parallel


def check_plan(
    plan: Plan, *, gradient_accumulation_steps: int | None, parallel: DataParallel | None
) -> int:
    """The accumulation steps of a loop that runs ``plan``, after checking it was made for it.

    Raises:
        ConfigError: not a Plan; ``gradient_accumulation_steps`` given and not the plan's; a
            plan for another world size than DDP's or FSDP2's ranks (without either, the world
            size is :func:`autobatch.probing.check_plan_here`'s to check); a mixed
            plan of another rank (its ``micro_batch_size`` is not this rank's entry of
            ``rank_micro_batch_sizes``); or, for a loop
            that skips the gradient reduction between micro-steps (DDP or FSDP2 with more than
            one), a plan measured in another gradient-sync mode or with another wrapper.
    """
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be an autobatch.Plan, got {type(plan).__name__}")
    steps = plan.gradient_accumulation_steps
    if gradient_accumulation_steps is not None and gradient_accumulation_steps != steps:
        raise ConfigError(
            f"gradient_accumulation_steps={gradient_accumulation_steps!r} disagrees with the "
            f"plan's {steps}; pass one of them"
        )
    if parallel is None:  # the world size of a loop without DDP or FSDP2: check_plan_here's
        return steps
    world_size = parallel.world_size
    if plan.world_size != world_size:
        raise ConfigError(
            f"the plan is for {plan.world_size} data-parallel rank(s), but this loop has "
            f"{world_size} (the group {parallel.wrapper} uses), so each optimizer step would see "
            f"an effective batch of {plan.effective_batch_size // plan.world_size * world_size}, "
            f"not {plan.effective_batch_size}; plan for world_size={world_size}"
        )
    sizes = plan.rank_micro_batch_sizes
    if sizes is not None:
        import torch.distributed as dist

        rank = dist.get_rank(parallel.group)
        if sizes[rank] != plan.micro_batch_size:
            raise ConfigError(
                f"the mixed plan gives rank {rank} (this one) micro-batches of {sizes[rank]}, "
                f"but this plan is a rank's of micro_batch_size {plan.micro_batch_size}; pass "
                "each rank its own plan (autotune(mixed_ranks=True) returns it on each rank)"
            )
    if steps == 1:
        return steps
    measured = plan.gradient_sync
    if measured.mode == "" and plan.source == "given":
        return steps  # a number of the user's: nothing was measured
    if measured.mode == "once_per_window" and measured.wrapper == parallel.wrapper:
        return steps
    held = "gradients" if parallel.ddp is not None else "unsharded gradients (the whole model's)"
    raise ConfigError(
        f"this loop runs {steps} micro-steps per window with the gradient reduction of "
        f"{parallel.wrapper} skipped on all but the last, so their {held} stay in memory "
        f"between them; but the plan was measured {measured.describe()}, so its micro-batch may "
        f"not fit in this loop. Plan again with autobatch.autotune on this {parallel.wrapper} "
        "model (it measures two micro-steps, the first without the reduction), or pass "
        "gradient_accumulation_steps=... without a plan to run it anyway"
    )
