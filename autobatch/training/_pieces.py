"""Cutting a micro-batch into pieces, for :mod:`autobatch.training._oom_split`: the rows it has,
where the cuts fall, the rows of one piece, and the layer that keeps a piece above 1 row.

Example::

    rows = rows_to_cut(batch, window_index=0, micro_index=2)   # 7 rows
    for start, stop in piece_bounds(0, rows, 3, min_rows=2):   # (0, 3), (3, 5), (5, 7)
        piece = slice_rows(batch, start, stop, rows)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map

from autobatch.errors import ConfigError
from autobatch.training._counting import leading_dim

__all__ = ["batch_norm_layer", "piece_bounds", "rows_to_cut", "slice_rows"]


def rows_to_cut(batch: Any, window_index: int, micro_index: int) -> int:
    """Rows of a micro-batch to be cut into pieces (the dim 0 of its first tensor).

    Raises:
        ConfigError: nothing in it can be cut: no tensor with a batch dimension in a tensor or
            a tuple/list/dict of them (an object of the user's, a list of samples).
    """
    try:
        return leading_dim(batch)
    except ConfigError:
        pass
    raise ConfigError(
        f"on_oom='split' cannot cut micro-batch {micro_index} of window {window_index} (a "
        f"{type(batch).__name__}) into pieces: it needs a tensor, or a tuple/list/dict of tensors "
        "with the batch dimension first (collate the samples into one, e.g. with "
        "torch.utils.data.default_collate), or use on_oom='raise'"
    )


def piece_bounds(start: int, stop: int, size: int, min_rows: int) -> list[tuple[int, int]]:
    """Rows ``[start:stop)`` cut into pieces ``(first, end)`` of ``size`` rows (the last fewer),
    none below ``min_rows`` where the rows allow: a last piece that is too short takes rows from
    the one before (8 rows by 3, at least 2: 3, 3, 2; 7 by 3: 3, 2, 2), or, when that one cannot
    spare them, joins it (5 by 2: 2, 3).
    """
    bounds = [*range(start, stop, size), stop]
    pieces = list(zip(bounds, bounds[1:], strict=False))
    if len(pieces) > 1 and stop - pieces[-1][0] < min_rows:
        first = pieces[-2][0]
        cut = stop - min_rows  # where the last piece would start with min_rows rows
        pieces[-2:] = [(first, cut), (cut, stop)] if cut - first >= min_rows else [(first, stop)]
    return pieces


def batch_norm_layer(
    model: torch.nn.Module, *, wrapped: bool
) -> tuple[str, torch.nn.Module] | None:
    """The first layer that normalises with its batch's statistics (any BatchNorm in training
    mode, or without running statistics), with its name; None when there is none. A piece of 1
    sample gives such a layer 1 value per channel (an ``(N, C)`` input), which torch refuses."""
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and (module.training or module.running_mean is None):
            return (name.removeprefix("module.") if wrapped else name), module
    return None


def slice_rows(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``[start:stop)`` of every tensor in ``batch`` whose dim 0 is ``rows`` (views); a
    mapping that is not a dict (``BatchEncoding``) keeps its type."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == rows:
            return leaf[start:stop]
        return leaf

    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        # Hugging Face's BatchEncoding, a UserDict: cut its dict, and give the piece its type
        # back (code reads batch.input_ids), when that type can be built from a dict.
        pieces = tree_map(cut, dict(batch))
        kind: Callable[[dict[Any, Any]], Any] = type(batch)
        try:
            return kind(pieces)
        except Exception:  # noqa: BLE001 - a mapping type that cannot: the dict serves
            return pieces
    return tree_map(cut, batch)
