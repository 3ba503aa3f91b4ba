"""The probe's sample from a dataset's heaviest items, so the probe measures the batch that fails.

A probe measures the batches it is shown. Shown a typical batch, it answers a size that runs out
of memory the first time a long sequence (or a label-heavy image) comes by, hours into training.
:func:`worst_case_sample` scans a map-style dataset with a load measure of the user's (sequence
length, number of labels...), keeps its heaviest items (or those at a percentile of the load) and
returns a ``n -> batch`` callable that collates ``n`` of them, repeated in turn. The profile
records the load in its notes.

Example::

    sample = worst_case_sample(dataset, key=lambda item: len(item["input_ids"]),
                               collate_fn=pad_collate)
    plan = autobatch.autotune(model, sample, effective_batch_size=256, device="cuda:0")
    sample.load            # e.g. 1024: the longest sequence the probe trained on
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

from autobatch.device import is_oom
from autobatch.errors import ConfigError

__all__ = ["WorstCaseSample", "worst_case_sample"]


class WorstCaseSample:
    """``n -> batch``: the collated batch of ``n`` of a dataset's heaviest items, in turn.

    Attributes:
        items: the items kept, heaviest first.
        load: the heaviest kept item's load (by ``key``): what the probe is measured at.
        percentile: the percentile of the dataset's loads asked for (100: the maximum).
        num_scanned: items in the dataset.
        key_name: the load measure's name, for the profile's note.
    """

    __slots__ = ("collate_fn", "items", "key_name", "load", "num_scanned", "percentile")

    def __init__(
        self,
        *,
        items: Sequence[Any],
        collate_fn: Callable[[list[Any]], Any],
        load: float,
        percentile: float,
        num_scanned: int,
        key_name: str,
    ) -> None:
        self.items = tuple(items)
        self.collate_fn = collate_fn
        self.load = load
        self.percentile = percentile
        self.num_scanned = num_scanned
        self.key_name = key_name

    def __call__(self, micro_batch_size: int) -> Any:
        """The collated batch of ``micro_batch_size`` items (>= 1), cycling through
        :attr:`items`."""
        items = self.items
        return self.collate_fn([items[i % len(items)] for i in range(micro_batch_size)])

    def describe(self) -> str:
        """One line for a profile's notes: the load the probe was measured at."""
        where = "the largest" if self.percentile == 100 else f"percentile {self.percentile:g}"
        return (
            f"probed at the worst-case load: {self.key_name} = {self.load:g} ({where} of "
            f"{self.num_scanned} items; {len(self.items)} heaviest kept)"
        )

    def __repr__(self) -> str:
        return f"WorstCaseSample({self.describe()})"


def worst_case_sample(
    dataset: Sequence[Any],
    *,
    key: Callable[[Any], float] = len,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    percentile: float = 100.0,
    num_items: int = 8,
) -> WorstCaseSample:
    """A probe sample made of the dataset's heaviest items by ``key``.

    Args:
        dataset: map-style: ``len(dataset)`` and ``dataset[i]`` (a list, a torch ``Dataset``,
            a Hugging Face ``Dataset``). Every item is read once to measure it.
        key: an item's load, a real number: its length (the default, ``len``), its number of
            labels, its pixels. For a dict item pass e.g. ``lambda item: len(item["input_ids"])``,
            for a tuple ``(input, target)`` e.g. ``lambda item: len(item[0])``.
        collate_fn: turns a list of items into a batch (pad them to the longest); default
            ``torch.utils.data.default_collate``.
        percentile: in (0, 100]: keep items whose load is at most this percentile of the loads
            (nearest rank), heaviest first; 100 keeps the heaviest. Use e.g. 99.9 when the very
            longest items will be truncated or filtered in training.
        num_items: items kept (>= 1); a batch of ``n`` repeats them in turn.

    Returns:
        A :class:`WorstCaseSample`, which ``probe``/``autotune``/``estimate`` accept as their
        ``sample`` (a callable ``n -> batch``).

    Raises:
        ConfigError: the dataset is empty or not map-style; ``percentile`` or ``num_items``
            out of range; ``collate_fn`` cannot batch the kept items (it is tried once on
            them); ``key`` returned something that is not a finite real number; or the default
            ``key=len`` met a dict or tuple item (e.g. a ``TensorDataset``'s
            ``(input, target)``: its len counts fields).
    """
    if isinstance(percentile, bool) or not (
        isinstance(percentile, int | float) and 0 < percentile <= 100
    ):
        raise ConfigError(f"percentile must be in (0, 100], got {percentile!r}; 100 is the max")
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
        raise ConfigError(f"num_items must be an int >= 1, got {num_items!r}")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"dataset of type {type(dataset).__name__} is not map-style (len and [i]); pass a "
            "list of candidate items, e.g. list(itertools.islice(iterable_dataset, 10_000))"
        )
    size = len(dataset)
    if size == 0:
        raise ConfigError("dataset is empty; give at least one item to probe with")
    key_name = getattr(key, "__name__", type(key).__name__)
    loads: list[float] = []
    for index in range(size):
        item = dataset[index]
        if key is len and isinstance(item, Mapping | tuple):
            field = "item['input_ids']" if isinstance(item, Mapping) else "item[0]"
            raise ConfigError(
                f"item {index} is a {type(item).__name__}, whose len() counts its fields "
                f"({len(item)}), not its load; pass key=lambda item: len({field}) (or the "
                "field to measure)"
            )
        value = key(item)
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise ConfigError(
                f"key {key_name} returned {value!r} for item {index}; it must return the item's "
                "load as a finite number (its length, its number of labels...)"
            )
        loads.append(float(value))
    threshold = sorted(loads)[max(0, math.ceil(percentile / 100 * size) - 1)]
    order = sorted((i for i in range(size) if loads[i] <= threshold), key=lambda i: (-loads[i], i))[
        :num_items
    ]
    if collate_fn is None:
        from torch.utils.data import default_collate

        collate_fn = default_collate
    sample = WorstCaseSample(
        items=[dataset[i] for i in order],
        collate_fn=collate_fn,
        load=loads[order[0]],
        percentile=float(percentile),
        num_scanned=size,
        key_name=key_name,
    )
    _check_collate(sample)
    return sample


def _check_collate(sample: WorstCaseSample) -> None:
    """Batch the kept items once, so a collate_fn that cannot is named here, not in the probe.

    Raises:
        ConfigError: ``collate_fn`` raised on them (an out-of-memory error propagates).
    """
    try:
        sample(len(sample.items))
    except Exception as exc:
        if is_oom(exc):
            raise
        name = getattr(sample.collate_fn, "__name__", type(sample.collate_fn).__name__)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"collate_fn {name} cannot batch the {len(sample.items)} items kept "
            f"({type(exc).__name__}: {first}); the heaviest items differ in length, so pass a "
            "collate_fn that pads them to the longest (e.g. transformers' "
            "DataCollatorWithPadding, or your training DataLoader's collate_fn)"
        ) from exc
