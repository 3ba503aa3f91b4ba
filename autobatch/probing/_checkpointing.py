"""Activation checkpointing applied to a model's repeated blocks, and undone.

A mode (:data:`CheckpointingMode`) says which blocks recompute their activations in backward
instead of keeping them: ``"none"`` (the model as given), ``"selective"`` (every ``every``-th
block, as torchtitan's ``selective`` layer mode: blocks ``0, every, 2*every...``) or ``"full"``
(every block). The blocks are the model's repeated layers (:func:`checkpointable_blocks`).
Each chosen block's forward runs under non-reentrant ``torch.utils.checkpoint.checkpoint``
(``use_reentrant=False``, the form PyTorch recommends: keyword arguments, DDP and FSDP2 work)
through an instance attribute ``forward`` set on the block itself: no module is replaced, no
parameter or buffer is renamed, and the undo deletes the attribute, so the model's modules are
the same objects with the same state afterwards.

What a recompute must not do twice, it does once:

- Running statistics (BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``,
  any ``_NormBase`` tracking them): the backward's recompute runs the block's forward again in
  training mode, which would update them a second time (``torch.utils.checkpoint`` alone has
  this fault; fairscale's ``patch_batchnorm`` guards against it). The recompute runs under a
  ``context_fn`` that saves those buffers before it and puts them back after it, so a step
  leaves them exactly as the same step without checkpointing (the outputs are the same: in
  training mode normalization uses the batch's statistics).
- A Hugging Face model's key/value cache: a decoder layer appends to the cache it is given, in
  place, so the recompute would append again, and a live cache holds every layer's keys and
  values beside the checkpointed activations. As Hugging Face's own gradient checkpointing
  does, ``config.use_cache`` is set to False on every config of the model while checkpointing
  is applied (put back by the undo and by :func:`remove_activation_checkpointing`), and a
  checkpointed transformers block is called with ``use_cache=False`` and no cache
  (``past_key_value(s)``, ``layer_past``, ``cache``: None) when gradients are on.

Example::

    with activation_checkpointing_applied(model, "full"):
        loss = model(**batch).loss     # every block recomputes in backward
        loss.backward()
    undo = apply_activation_checkpointing(model, "selective", every=2)   # for training
    remove_activation_checkpointing(model)   # or undo(): the model as it was
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, get_args

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from autobatch.errors import ConfigError
from autobatch.profile import CheckpointingMode

__all__ = [
    "CACHE_TURNED_OFF",
    "CHECKPOINTING_MODES",
    "CheckpointedForward",
    "CheckpointingMode",
    "activation_checkpointing_applied",
    "apply_activation_checkpointing",
    "checkpointable_blocks",
    "checkpointed_blocks",
    "describe_applied",
    "remove_activation_checkpointing",
]

CHECKPOINTING_MODES: tuple[CheckpointingMode, ...] = get_args(CheckpointingMode)
"""The modes in order of recompute, least first."""

DEFAULT_EVERY = 2
"""``"selective"`` checkpoints every 2nd block by default (torchtitan's ``selective_ac_option``
``"2"``): about half the blocks' activations for about half the recompute."""


_CACHE_KEYWORDS = ("past_key_values", "past_key_value", "layer_past", "cache")
"""The names Hugging Face layers take their key/value cache by."""


class CheckpointedForward:
    """A block's forward run under ``checkpoint(..., use_reentrant=False)`` when gradients are
    on (in ``no_grad``/``inference_mode`` the plain forward runs: nothing to save); the
    recompute leaves running statistics as the forward left them, and a transformers block
    gets no cache (see the module docstring)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        previous: Callable[..., Any] | None,
        block: torch.nn.Module,
    ) -> None:
        self.forward = forward
        """The block's own forward (bound)."""
        self.previous = previous
        """The instance ``forward`` the block had before (None: none), put back by the undo."""
        self.statistics = [
            m for m in block.modules() if isinstance(m, _NormBase) and m.track_running_stats
        ]
        """The block's modules whose running statistics the recompute must not update."""
        self.uncached = type(block).__module__.startswith("transformers.")
        """A transformers block: called without its key/value cache when checkpointed."""
        self.configs: list[Any] = []
        """Configs whose ``use_cache`` this application turned off (kept on one block's)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        if self.uncached:
            kwargs.update(
                {k: None for k in _CACHE_KEYWORDS if kwargs.get(k) is not None},
                **({"use_cache": False} if kwargs.get("use_cache") else {}),
            )
        return checkpoint(
            self.forward, *args, use_reentrant=False, context_fn=self._contexts, **kwargs
        )

    def _contexts(self) -> tuple[contextlib.AbstractContextManager[None], Any]:
        """(forward's context, recompute's context) for ``checkpoint``'s ``context_fn``."""
        return contextlib.nullcontext(), _statistics_kept(self.statistics)


@contextlib.contextmanager
def _statistics_kept(modules: list[_NormBase]) -> Iterator[None]:
    """Run the block's recompute, then put its running statistics back as they were before."""
    saved = [
        [(buffer, buffer.detach().clone()) for buffer in m.buffers(recurse=False)]
        for m in modules
        if m.training
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for pairs in saved:
                for buffer, before in pairs:
                    buffer.copy_(before)


def checkpointable_blocks(
    model: torch.nn.Module, *, block_class: type[torch.nn.Module] | str | None = None
) -> list[torch.nn.Module]:
    """The model's repeated blocks, in order: the modules of ``block_class`` (a class or its
    name, subclasses included) when given, else the items of every outermost ``nn.ModuleList``
    of 2 or more layers, modules with modules of their own, of one class or several (a
    transformers model's ``layers``/``h``/``layer``; a hybrid stack such as Jamba's; an
    encoder-decoder's two stacks; grouped blocks in nested lists: the blocks themselves,
    never a list, whose forward never runs). Single modules (a list of Linears: MoE experts,
    output heads) are never blocks.

    Raises:
        ConfigError: no module of ``block_class``, or no repeated blocks found (names
            ``block_class=`` as the fix).
    """
    if block_class is not None:
        name = block_class if isinstance(block_class, str) else block_class.__qualname__
        # By the class or any it derives from: FSDP2's fully_shard swaps a block's class for a
        # subclass of it (FSDPGPT2Block), so the exact class would match nothing.
        blocks = [
            m for m in model.modules() if any(c.__qualname__ == name for c in type(m).__mro__)
        ]
        if not blocks:
            raise ConfigError(
                f"activation checkpointing: block_class={name!r} matches no module of "
                f"{type(model).__qualname__}; name the class of its repeated blocks "
                "(e.g. block_class='GPT2Block')"
            )
        return blocks
    blocks = _stacks(model)
    if not blocks:
        raise ConfigError(
            f"activation checkpointing: {type(model).__qualname__} has no nn.ModuleList of "
            "repeated blocks; name the class of the blocks to checkpoint with block_class= "
            "(e.g. block_class='TransformerBlock')"
        )
    return blocks


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)
"""Modules that hold modules and have no forward of their own: never a block."""


def _items(container: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a container holds, nested containers opened (a ModuleList of ModuleLists:
    grouped blocks), in order."""
    found: list[torch.nn.Module] = []
    for item in container.children():
        found.extend(_items(item) if isinstance(item, _CONTAINERS) else [item])
    return found


def _stacks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every stack of repeated blocks in ``module`` (itself included), in order:
    the items of each outermost ``nn.ModuleList`` holding 2 or more layers (nested lists
    opened), so an encoder-decoder's two stacks are both found; a stack's blocks are not
    searched for stacks of their own. A layer is a module with modules of its own: a hybrid
    stack (attention and Mamba or MoE layers, as Jamba's) is one stack of mixed classes, and a
    list of single modules (MoE experts, output heads: Linears) is never a stack, for a leaf
    keeps no activation that recomputing would save."""
    if isinstance(module, torch.nn.ModuleList):
        items = _items(module)
        if len(items) >= 2 and all(_is_layer(item) for item in items):
            return items
    return [block for child in module.children() for block in _stacks(child)]


def _is_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds modules of its own (a Linear, a norm, an embedding does not)."""
    return next(module.children(), None) is not None


def _chosen(blocks: list[torch.nn.Module], mode: str, every: int) -> list[torch.nn.Module]:
    if mode not in CHECKPOINTING_MODES:
        raise ConfigError(
            f"activation_checkpointing={mode!r} is not a mode; give one of "
            f"{', '.join(repr(m) for m in CHECKPOINTING_MODES)}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"activation checkpointing every={every!r} must be an int >= 1 (checkpoint every "
            "n-th block); give e.g. every=2"
        )
    if mode == "none":
        return []
    if mode == "full":
        return blocks
    return blocks[::every]


def apply_activation_checkpointing(
    model: torch.nn.Module,
    mode: CheckpointingMode,
    *,
    every: int = DEFAULT_EVERY,
    block_class: type[torch.nn.Module] | str | None = None,
) -> Callable[[], None]:
    """Checkpoint ``model``'s blocks in ``mode`` (see the module docstring), in place, and
    return the undo: a function that puts every block's forward back as it was (call it once).
    While applied, a Hugging Face model's ``config.use_cache`` is False (as its own gradient
    checkpointing has it); the undo turns it back on.

    Args:
        model: the model (a DDP- or FSDP2-wrapped one too: the blocks are found inside).
        mode: ``"none"`` (nothing changes), ``"selective"`` or ``"full"``.
        every: with ``"selective"``, checkpoint blocks ``0, every, 2*every...`` (>= 1).
        block_class: the blocks' class or class name; None: found
            (:func:`checkpointable_blocks`).

    Raises:
        ConfigError: an unknown mode, ``every`` < 1, no blocks found, or a block already
            checkpointed here.
    """
    if mode == "none":
        _chosen([], mode, every)
        return lambda: None
    blocks = _chosen(checkpointable_blocks(model, block_class=block_class), mode, every)
    if any(isinstance(b.__dict__.get("forward"), CheckpointedForward) for b in blocks):
        raise ConfigError(
            "activation checkpointing is already applied to this model's blocks; call the undo "
            "apply_activation_checkpointing returned before applying another mode"
        )
    for block in blocks:
        previous = block.__dict__.get("forward")
        own = previous if previous is not None else type(block).forward.__get__(block)
        block.forward = CheckpointedForward(own, previous, block)
    blocks[-1].__dict__["forward"].configs = _caches_off(model)  # its undo turns them back on

    def undo() -> None:
        for block in blocks:
            wrapped = block.__dict__.pop("forward", None)
            if isinstance(wrapped, CheckpointedForward):
                _unwrapped(block, wrapped)

    return undo


CACHE_TURNED_OFF = "_autobatch_use_cache_turned_off"
"""The private attribute set True on a config whose ``use_cache`` checkpointing turned off:
the model's fingerprint (:mod:`autobatch.probing._identity`) reads ``use_cache`` as the model
was given, so a profile measured under autobatch's checkpointing and one of the same model
checkpointed by hand share their key (the checkpointing is a condition of its own)."""


def _caches_off(model: torch.nn.Module) -> list[Any]:
    """Turn ``use_cache`` off on every config of ``model``'s modules that has it on (a Hugging
    Face model's), marked :data:`CACHE_TURNED_OFF`; returns those configs, for
    :func:`_unwrapped` to turn back on."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
        setattr(config, CACHE_TURNED_OFF, True)
    return list(configs.values())


def _unwrapped(block: torch.nn.Module, wrapped: CheckpointedForward) -> None:
    """Put ``block``'s forward and the configs ``wrapped`` keeps back as they were (the
    ``forward`` attribute is already removed)."""
    if wrapped.previous is not None:
        block.forward = wrapped.previous
    for config in wrapped.configs:
        config.use_cache = True
        config.__dict__.pop(CACHE_TURNED_OFF, None)
    wrapped.configs = []


@contextlib.contextmanager
def activation_checkpointing_applied(
    model: torch.nn.Module,
    mode: CheckpointingMode,
    *,
    every: int = DEFAULT_EVERY,
    block_class: type[torch.nn.Module] | str | None = None,
) -> Iterator[torch.nn.Module]:
    """:func:`apply_activation_checkpointing` for the ``with`` block, undone on the way out
    (an exception too); yields the model.

    Raises:
        ConfigError: as :func:`apply_activation_checkpointing`.
    """
    undo = apply_activation_checkpointing(model, mode, every=every, block_class=block_class)
    try:
        yield model
    finally:
        undo()


def remove_activation_checkpointing(model: torch.nn.Module) -> int:
    """Undo every :func:`apply_activation_checkpointing` on ``model``'s modules (the drop-ins'
    too, which keep no undo for you): each checkpointed block's forward is put back as it was,
    and ``config.use_cache`` turned back on where checkpointing turned it off.

    Returns:
        How many blocks were checkpointed (0: nothing to undo).
    """
    count = 0
    for module in model.modules():
        wrapped = module.__dict__.get("forward")
        if isinstance(wrapped, CheckpointedForward):
            del module.__dict__["forward"]
            _unwrapped(module, wrapped)
            count += 1
    return count


def checkpointed_blocks(model: torch.nn.Module) -> int:
    """How many of ``model``'s modules this module checkpoints now."""
    return sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in model.modules())


def describe_applied(model: torch.nn.Module) -> str:
    """The checkpointing applied here, as the live conditions record it (``""`` for none):
    ``"autobatch checkpoint on 2 blocks (torch.utils.checkpoint, use_reentrant=False)"``."""
    count = checkpointed_blocks(model)
    if not count:
        return ""
    return f"autobatch checkpoint on {count} blocks (torch.utils.checkpoint, use_reentrant=False)"
