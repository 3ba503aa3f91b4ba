"""Micro-batches of any size from one sample batch.

A sample is a tensor, or a (nested) tuple/list/dict of tensors, batch dimension first; every tensor
must agree on dim 0. A micro-batch of size ``n`` repeats the sample's rows cyclically
(``rows[i % b]``), so content and dtype match the user's data. A callable sample ``n -> batch`` is
called instead. Non-tensor leaves (ints, strings, None) pass through unchanged.

Example::

    source = BatchSource.from_sample({"input_ids": ids, "labels": ids})   # ids: (4, 128)
    source.make(10)["input_ids"].shape      # torch.Size([10, 128])
    source.sample_shapes                    # {"input_ids": (128,), "labels": (128,)}
    BatchSource.from_sample((x, y)).sample_shapes   # {"0": (32,), "1": ()}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_map

from autobatch.errors import ConfigError
from autobatch.probing._snapshot import preserved_rng

__all__ = ["BatchSource", "batch_tensors"]


def _plain(batch: Any) -> Any:
    """A mapping that is not a dict (Hugging Face ``BatchEncoding``, a ``UserDict``) as a dict,
    so its tensors are seen; anything else unchanged."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return dict(batch)
    return batch


def _path_name(path: tuple[Any, ...]) -> str:
    """A tensor's place in the batch: ``"input_ids"``, ``"0"``, ``"inputs.mask"``; ``"sample"``
    for a bare tensor."""
    parts = []
    for entry in path:
        for attribute in ("key", "idx", "name"):  # dict key, sequence index, attribute
            if hasattr(entry, attribute):
                parts.append(str(getattr(entry, attribute)))
                break
        else:
            parts.append(str(entry))
    return ".".join(parts) or "sample"


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor leaf of a (nested) batch."""
    leaves, _ = tree_flatten_with_path(batch)
    return [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]


def _check(
    batch: Any, *, what: str
) -> tuple[int, dict[str, tuple[int, ...]], dict[str, str], torch.device]:
    """Validate a batch: returns (rows, per-sample shapes by path, dtypes by path, device)."""
    leaves, _ = tree_flatten_with_path(batch)
    tensors = [(_path_name(path), t) for path, t in leaves if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ConfigError(
            f"{what} holds no tensor (got {type(batch).__name__}); pass a tensor, or a "
            "tuple/list/dict of tensors with the batch dimension first"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    rows: int | None = None
    device: torch.device | None = None
    for name, tensor in tensors:
        if tensor.dim() == 0:
            raise ConfigError(
                f"{what} tensor {name} is a 0-d scalar; every tensor needs a batch dimension "
                "first (use tensor.unsqueeze(0)) or pass a callable n -> batch"
            )
        if tensor.shape[0] == 0:
            raise ConfigError(
                f"{what} tensor {name} has batch dimension 0 (shape {tuple(tensor.shape)}); "
                "give at least one sample"
            )
        if rows is None:
            rows, device = tensor.shape[0], tensor.device
        elif tensor.shape[0] != rows:
            first = tensors[0][0]
            raise ConfigError(
                f"{what} tensors disagree on the batch dimension: {first} has {rows} rows, "
                f"{name} has {tensor.shape[0]}; every tensor must have the batch dimension first"
            )
        elif tensor.device != device:
            raise ConfigError(
                f"{what} tensors are on different devices: {tensors[0][0]} on {device}, "
                f"{name} on {tensor.device}; move the whole batch with .to(device)"
            )
        shapes[name] = tuple(tensor.shape[1:])
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
    assert rows is not None and device is not None
    return rows, shapes, dtypes, device


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BatchSource:
    """Builds micro-batches of a requested size from a sample or a user function."""

    sample_shapes: Mapping[str, tuple[int, ...]]
    """Shape of one sample per tensor, batch dimension removed, keyed by its path in the batch."""
    sample_dtypes: Mapping[str, str]
    """Dtype of each tensor (``"int64"``, ``"float32"``...), keyed like ``sample_shapes``."""
    device: torch.device
    """Where the batches' tensors live."""
    _sample: Any = None
    _factory: Callable[[int], Any] | None = None

    @classmethod
    def from_sample(cls, sample: Any) -> BatchSource:
        """Wrap a sample batch or a callable ``n -> batch``.

        Raises:
            ConfigError: no tensor, a 0-d tensor, a zero-size batch, tensors that disagree on
                dim 0 or on device, or a callable whose batch of 1 is not of size 1.
        """
        if callable(sample) and not isinstance(sample, torch.Tensor):
            try:
                with preserved_rng():  # building a sample must not move the user's RNG
                    probe_batch = _plain(sample(1))
            except Exception as exc:
                raise ConfigError(
                    f"sample(1) raised {type(exc).__name__}: {exc}; the callable must return a "
                    "batch of n rows for n"
                ) from exc
            rows, shapes, dtypes, device = _check(probe_batch, what="the batch from sample(1)")
            if rows != 1:
                raise ConfigError(
                    f"sample(1) returned a batch of {rows} rows; the callable must return exactly "
                    "n rows for n"
                )
            return cls(sample_shapes=shapes, sample_dtypes=dtypes, device=device, _factory=sample)
        sample = _plain(sample)
        _, shapes, dtypes, device = _check(sample, what="sample")
        return cls(sample_shapes=shapes, sample_dtypes=dtypes, device=device, _sample=sample)

    def make(self, micro_batch_size: int) -> Any:
        """A batch of ``micro_batch_size`` rows (> 0) on :attr:`device`."""
        if micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size {micro_batch_size} must be >= 1")
        if self._factory is not None:
            batch = _plain(self._factory(micro_batch_size))
            rows, _, _, _ = _check(batch, what=f"the batch from sample({micro_batch_size})")
            if rows != micro_batch_size:
                raise ConfigError(
                    f"sample({micro_batch_size}) returned {rows} rows; it must return exactly n"
                )
            return batch

        def tile(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            index = torch.arange(micro_batch_size, device=leaf.device) % leaf.shape[0]
            return leaf.index_select(0, index)

        return tree_map(tile, self._sample)
