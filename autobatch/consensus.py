"""How the ranks of a data-parallel job agree during a probe: the :class:`Consensus` protocol
and :class:`LocalConsensus`, the one of a single process (under torch.distributed:
:class:`autobatch.distributed.ProcessGroupConsensus`).

Example::

    consensus = LocalConsensus()
    consensus.min_ints([3, 5])   # [3, 5]: one process, every value already agreed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Consensus", "LocalConsensus"]


class Consensus(Protocol):
    """How the ranks of a data-parallel job agree during a probe.

    Every rank makes the same calls in the same order, with sequences of the same length.
    """

    @property
    def rank(self) -> int:
        """This process's rank, in ``[0, world_size)``."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over the ranks, on every rank."""
        ...

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank."""
        ...


class LocalConsensus:
    """The consensus of a single process: every value is already agreed."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def min_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)
