"""Gradient synchronisation of a data-parallel model: which wrapper reduces the gradients
(``DistributedDataParallel``, FSDP2's ``fully_shard``), over which ranks, and how to skip that
reduction on the micro-steps before a window's last, so that a window of k micro-steps reduces
once: DDP's ``no_sync()``, FSDP2's own ``set_requires_gradient_sync(False)``.

The Accumulator drives it (:mod:`autobatch.training`), and the probe measures the step as such a
loop runs it (two micro-steps, the first unsynchronised: FSDP2 then holds the whole model's
unsharded gradients between them). Both reduce by averaging over the data-parallel ranks, so the
Accumulator's weights (``count * world_size / global count``) give the global mean under either.

Wrappers it cannot drive are refused by name rather than run without the Accumulator knowing:
FSDP1 (``FullyShardedDataParallel``) and an engine that owns accumulation (DeepSpeed's: it scales
each loss by its own accumulation steps and steps at its own boundaries).

Example::

    parallel = data_parallel(model)       # None for a module without DDP or FSDP2
    with parallel.skipped():              # a micro-step before the window's last
        loss.backward()
    parallel.world_size, parallel.wrapper
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from autobatch.distributed._layout import FSDP2_LAYOUT
from autobatch.errors import ConfigError

__all__ = [
    "DDP_WRAPPER",
    "FSDP2_WRAPPER",
    "DataParallel",
    "data_parallel",
    "drop_unsharded_gradients",
    "owns_accumulation",
    "refuse_engine",
]

DDP_WRAPPER = "DistributedDataParallel"
FSDP2_WRAPPER = FSDP2_LAYOUT


class DataParallel:
    """A model's data-parallel gradient reduction (build it with :func:`data_parallel`).

    Attributes:
        wrapper: :data:`DDP_WRAPPER` or :data:`FSDP2_WRAPPER`.
        model: the model as given (the DDP wrapper, or the FSDP2 model).
        group: the process group the gradients are averaged over (None: the default group).
        world_size: the ranks in it: the data-parallel size.
    """

    __slots__ = ("_fsdp", "group", "model", "world_size", "wrapper")

    def __init__(
        self,
        wrapper: str,
        model: torch.nn.Module,
        group: dist.ProcessGroup | None,
        fsdp: tuple[torch.nn.Module, ...] = (),
    ) -> None:
        self.wrapper = wrapper
        self.model = model
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._fsdp = fsdp

    @property
    def forward_communicates(self) -> bool:
        """Whether a forward pass runs collectives: FSDP2's all-gathers, DDP's broadcast of
        the module's buffers."""
        ddp = self.ddp
        return ddp is None or bool(ddp.will_sync_module_buffers())  # type: ignore[no-untyped-call]

    @property
    def ddp(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """The model when it is a ``DistributedDataParallel``."""
        model = self.model
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None

    def skipped(self) -> contextlib.AbstractContextManager[Any]:
        """A context whose backward passes do not reduce gradients (they accumulate, FSDP2's
        unsharded): ``no_sync()`` under DDP (enter it before the forward pass); under FSDP2 the
        switch is set off, and on again on leaving."""
        ddp = self.ddp
        if ddp is not None:
            return ddp.no_sync()
        return self._fsdp_skipped()

    @contextlib.contextmanager
    def _fsdp_skipped(self) -> Iterator[None]:
        self.set_sync(False)
        try:
            yield
        finally:
            self.set_sync(True)

    def set_sync(self, on: bool) -> None:
        """FSDP2: whether the next backward passes reduce (reduce-scatter) their gradients.
        DDP: nothing (its ``no_sync()`` must wrap the forward pass too: see :meth:`skipped`)."""
        for module in self._fsdp:
            module.set_requires_gradient_sync(on, recurse=False)  # type: ignore[operator]

    def drop_pending(self) -> None:
        """FSDP2: drop the unsharded gradients that backward passes without the reduction left
        (private FSDP2 state), which ``optimizer.zero_grad()`` does not reach; DDP: nothing."""
        drop_unsharded_gradients(self.model)


def drop_unsharded_gradients(model: torch.nn.Module) -> None:
    """Drop the unsharded gradients FSDP2 keeps between backward passes that did not reduce
    them (``unsharded_accumulated_grad``, and the unsharded parameters' ``grad``), so that they
    reach no later step. Private FSDP2 state (torch 2.13), pinned by the 2-rank tests."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param") and param.unsharded_param.grad is not None:
                    param.unsharded_param.grad = None


def data_parallel(model: torch.nn.Module, *, probing: bool = False) -> DataParallel | None:
    """The model's data-parallel gradient reduction, or None when it has none.

    Args:
        model: the module as trained.
        probing: for the probe, which measures FSDP1 and engines as they run: None for those
            instead of refusing them.

    Raises:
        ConfigError: (not when ``probing``) FSDP1, an engine that owns accumulation
            (DeepSpeed's), or an FSDP2 mesh whose data-parallel ranks are not one group (HSDP
            over part of the world); each names what to do instead.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DataParallel(DDP_WRAPPER, model, model.process_group)
    engine = owns_accumulation(model)
    if engine and not probing:
        raise ConfigError(_engine_refusal(engine, "model"))
    fsdp = tuple(m for m in model.modules() if isinstance(m, FSDPModule))
    if not fsdp:
        if not probing and any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            raise ConfigError(
                "the Accumulator does not drive FSDP1 (FullyShardedDataParallel): shard the "
                "model with FSDP2 (torch.distributed.fsdp.fully_shard), whose gradient "
                "reduction it skips on all but a window's last micro-step and whose ranks it "
                "weights exactly; or run FSDP1's own no_sync() loop yourself"
            )
        return None
    group = _fsdp2_group(fsdp, probing=probing)
    if group is False:
        return None
    return DataParallel(FSDP2_WRAPPER, model, group, fsdp)


def _fsdp2_group(fsdp: tuple[torch.nn.Module, ...], *, probing: bool) -> Any:
    """The group an FSDP2 model averages its gradients over (its data-parallel ranks): its
    1-D mesh's; for HSDP (replicate x shard) the default group when the mesh is the whole
    world. False (probing) or ConfigError for anything else."""
    meshes = [
        group.mesh_info.mesh
        for module in fsdp
        for group in module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    ]
    if not meshes:
        return None  # no parameter is sharded: the default group
    mesh = meshes[0]
    if any(other != mesh for other in meshes[1:]):
        if probing:
            return False
        raise ConfigError(
            "the model's fully_shard modules shard over different DeviceMeshes, so its "
            "data-parallel ranks are not one group; shard every module over the same mesh"
        )
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return None  # HSDP over the whole world: every rank is data-parallel
    if probing:
        return False
    raise ConfigError(
        f"the model is sharded with FSDP2 over a {mesh.ndim}-D DeviceMesh of shape "
        f"{tuple(mesh.shape)} {mesh.mesh_dim_names or ''} that is not the whole world "
        f"({dist.get_world_size()} ranks), so the Accumulator cannot tell one group of its "
        "data-parallel ranks to agree counts over; shard over a 1-D mesh (mesh['dp'])"
    )


def owns_accumulation(obj: object) -> str:
    """The class name of an engine that owns gradient accumulation (DeepSpeed's
    ``DeepSpeedEngine``, or a look-alike: ``backward``, ``step`` and
    ``is_gradient_accumulation_boundary`` methods), or of a class from the ``deepspeed``
    package (its optimizers are stepped by the engine); "" for anything else."""
    kind = type(obj)
    for cls in kind.__mro__:
        if cls.__module__.split(".")[0] == "deepspeed":
            return kind.__name__
    if all(
        callable(getattr(obj, name, None))
        for name in ("backward", "step", "is_gradient_accumulation_boundary")
    ):
        return kind.__name__
    return ""


def _engine_refusal(name: str, role: str) -> str:
    return (
        f"the {role} is a {name}, an engine that owns gradient accumulation: its "
        "engine.backward(loss) divides each loss by its own gradient_accumulation_steps and its "
        "engine.step() updates only at its own accumulation boundaries, so the Accumulator "
        "stepping it once per window would update once in many windows, with losses weighted "
        "twice. Drive it with its own loop (loss = engine(batch); engine.backward(loss); "
        "engine.step() for every micro-batch), configured from the plan with "
        "autobatch.integrations.deepspeed_config(plan)"
    )


def refuse_engine(obj: object, role: str) -> None:
    """Raise ConfigError when ``obj`` (passed as the ``role``) owns accumulation."""
    name = owns_accumulation(obj)
    if name:
        raise ConfigError(_engine_refusal(name, role))
