"""How many items a micro-batch counts: the default (its rows) and a checked ``count_fn`` result.

Shared by :mod:`autobatch.training._accumulator` (a window's weights) and
:mod:`autobatch.training._oom_split` (the
rows to cut a micro-batch into and the count of each piece).

Example::

    leading_dim({"input_ids": ids, "labels": ids})   # ids: (8, 128) -> 8
    as_count(torch.tensor(300), window=0, micro=1)    # 300 (a one-element integer tensor)
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Mapping

import torch

from autobatch.errors import ConfigError

__all__ = ["as_count", "leading_dim"]

# Containers the default count looks into (a tuple: isinstance checks it faster than a union).
_NESTED_BATCH = (tuple, list, Mapping)


def leading_dim(batch: object) -> int:
    """Dim-0 size of the first tensor in a tensor / tuple / list / dict batch.

    Raises:
        ConfigError: a 0-dim tensor, a list of samples, or no tensor with a dim 0 in it
            (pass ``count_fn``).
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ConfigError("a 0-dim tensor batch has no dim 0 to count; pass count_fn")
        return batch.shape[0]
    items: Iterable[object] = ()
    if isinstance(batch, tuple | list):
        if isinstance(batch, list) and batch and isinstance(batch[0], _NESTED_BATCH):
            raise ConfigError(
                f"a list batch whose first item is a {type(batch[0]).__name__} looks like a list "
                "of samples, whose count the default cannot tell from a field's size; pass "
                "count_fn=len (or the number of counted items)"
            )
        items = batch
    elif isinstance(batch, Mapping):  # dict, and UserDict such as Hugging Face's BatchEncoding
        items = batch.values()
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.dim():
                return item.shape[0]
        elif isinstance(item, _NESTED_BATCH):
            try:
                return leading_dim(item)
            except ConfigError:
                continue
    raise ConfigError(
        f"cannot count the samples of a {type(batch).__name__} batch: no tensor with a dim 0; "
        "pass count_fn=lambda batch: <number of counted items>"
    )


def as_count(value: int | torch.Tensor, window: int, micro: int) -> int:
    """Check a ``count_fn`` result and return it as an int.

    Args:
        value: what ``count_fn`` returned: an int, a one-element integer tensor, or an object
            with ``__index__`` (a NumPy integer).
        window: 0-based window number, for the message.
        micro: 0-based micro-batch number in the window, for the message.

    Returns:
        The count of items, >= 0.

    Raises:
        ConfigError: ``value`` is negative, a bool, a float, or a tensor with more than one
            element or a non-integer dtype.
    """
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, torch.Tensor):
        if (
            value.numel() != 1
            or value.is_floating_point()
            or value.is_complex()
            or value.dtype == torch.bool
        ):
            raise ConfigError(
                f"count_fn returned a tensor of shape {tuple(value.shape)} and dtype "
                f"{value.dtype} for micro-batch {micro} of window {window}; return an int or a "
                "one-element integer tensor"
            )
        value = int(value.item())
    elif not isinstance(value, bool | int):
        with contextlib.suppress(TypeError):
            value = operator.index(value)  # NumPy integers, e.g. (labels != -100).sum()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"count_fn returned {value!r} for micro-batch {micro} of window {window}; "
            "it must return the number of counted items, an int >= 0"
        )
    return value
