"""A callback for ``Accumulator(on_split=...)`` that lets the profile store learn the size
that really fitted in training (:func:`split_recorder`).

Example::

    acc = Accumulator(model, optimizer, gradient_accumulation_steps=8, on_oom="split",
                      on_split=split_recorder(model, sample, optimizer=optimizer))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from autobatch.device import Device, resolve_device
from autobatch.probing import (
    LossFn,
    StepSpec,
    TrainStep,
    compiled_mode,
    model_device,
    read_conditions,
)
from autobatch.store import ProfileStore
from autobatch.training import SplitEvent

__all__ = ["split_recorder"]


def split_recorder(
    model: torch.nn.Module,
    sample: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    device: str | Device | None = None,
    amp_dtype: torch.dtype | None = None,
    store: ProfileStore | str | os.PathLike[str] | None = None,
) -> Callable[[SplitEvent], None]:
    """A callback for ``Accumulator(on_split=...)``: the store learns the size that really fit.

    Give it the arguments given to :func:`autotune` (they name the stored profile). On each
    split, the newest profile under that key, if it allows more than the split's new size, is
    stored again with ``max_micro_batch_size`` and ``recommended_micro_batch_size`` lowered to it
    and a note saying why, so the next ``autotune`` starts from what fitted. Under
    torch.distributed only rank 0 writes.

    Example::

        acc = Accumulator(model, optimizer, gradient_accumulation_steps=plan.
                          gradient_accumulation_steps, on_oom="split",
                          on_split=split_recorder(model, sample, optimizer=optimizer,
                                                  device="cuda:0"))

    Raises:
        ConfigError: as :func:`autotune` for the arguments (when called); the callback raises
            StoreError when the store cannot be written.
    """
    step = StepSpec.build(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_step=train_step,
        step_includes_update=step_includes_update,
        amp_dtype=amp_dtype,
    )
    target = resolve_device(device, default=model_device(model))
    key = step.identity.cache_key(
        device_name=target.name,
        total_memory_bytes=target.capacity().total_memory_bytes,
        compiled=compiled_mode(model, target.type),
        conditions=read_conditions(model, optimizer, device_type=target.type, amp_dtype=amp_dtype),
    )

    def record(event: SplitEvent) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        opened = store if isinstance(store, ProfileStore) else ProfileStore(store)
        try:
            found = opened.find(key)
            if found is None or found[1].max_micro_batch_size <= event.new_micro_batch_size:
                return
            profile = found[1]
            size = event.new_micro_batch_size
            note = (
                f"lowered from {profile.max_micro_batch_size} to {size}: training ran out of "
                f"memory at micro-batch size {event.old_micro_batch_size} (window "
                f"{event.window_index}, micro-batch {event.micro_step_index}, {event.phase}: "
                f"{event.reason})"
            )
            opened.put(
                dataclasses.replace(
                    profile,
                    max_micro_batch_size=size,
                    recommended_micro_batch_size=min(profile.recommended_micro_batch_size, size),
                    notes=(*profile.notes, note),
                    stop_kind="boundary",
                    stop_reason=f"lowered to {size} after running out of memory in training",
                    created_at="",
                )
            )
        finally:
            if opened is not store:
                opened.close()

    return record
