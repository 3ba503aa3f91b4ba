"""Each rank's share of every global batch, for ranks that train micro-batches of different sizes
(a mixed plan: :func:`autobatch.planning.plan_mixed_ranks`, ``autotune(mixed_ranks=True)``).

One global batch (one optimizer step) is ``effective_batch_size = k * sum(m_r)`` rows of the
epoch's order, ``k`` the accumulation steps and ``m_r`` rank ``r``'s micro-batch. Micro-step
``j`` of it holds the ``sum(m_r)`` rows from ``j * sum(m_r)``; rank ``r`` takes the contiguous
``m_r`` of them after the ranks before it (:func:`rank_shares`). So every row of a global batch
goes to exactly one rank, and every rank yields ``k`` micro-batches per global batch: the
Accumulator's windows line up across the ranks, and weighting each micro-batch by its rows over
the window's rows of every rank (what it does) gives the gradient of the whole global batch.

The epoch's order is a permutation seeded by ``seed + epoch`` (:meth:`MixedBatchSampler.set_epoch`,
as for ``DistributedSampler``), the same on every rank. An epoch whose rows do not fill its last
global batch is padded with rows from its start (as ``DistributedSampler`` pads), so every rank
yields as many micro-batches; ``drop_last=True`` drops that batch instead (every optimizer step
then sees exactly the effective batch of distinct rows).

Example::

    plan = autobatch.autotune(model, sample, effective_batch_size=96, mixed_ranks=True)
    sampler = MixedBatchSampler.from_plan(len(dataset), plan, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        for window in acc.windows(loader):
            ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from autobatch.errors import ConfigError
from autobatch.planning import Plan

__all__ = ["MixedBatchSampler", "rank_shares"]


def rank_shares(
    rank_micro_batch_sizes: Sequence[int], gradient_accumulation_steps: int, rank: int
) -> list[range]:
    """Rank ``rank``'s rows of one global batch, by position in it (0 to ``k * sum(m_r) - 1``):
    one range of ``m_rank`` rows per accumulation step.

    Raises:
        ConfigError: a size that is not an int >= 1, ``gradient_accumulation_steps`` < 1, or a
            rank outside the sizes given.
    """
    sizes = list(rank_micro_batch_sizes)
    if not sizes or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in sizes):
        raise ConfigError(
            f"rank_micro_batch_sizes {sizes} must be one int >= 1 per rank, in rank order"
        )
    steps = gradient_accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"gradient_accumulation_steps {steps!r} must be an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(sizes):
        raise ConfigError(f"rank {rank!r} must be in [0, {len(sizes)}): one size per rank")
    per_step, offset = sum(sizes), sum(sizes[:rank])
    return [range(j * per_step + offset, j * per_step + offset + sizes[rank]) for j in range(steps)]


class MixedBatchSampler(Sampler[list[int]]):
    """A batch sampler (``DataLoader(batch_sampler=...)``) that yields this rank's micro-batches
    of every global batch: ``gradient_accumulation_steps`` lists of dataset indices of its own
    micro-batch size per global batch (module docstring).

    Args:
        num_rows: rows in the dataset (``len(dataset)``), >= 1.
        rank_micro_batch_sizes: every rank's micro-batch, in rank order (a mixed plan's).
        gradient_accumulation_steps: micro-batches per rank per optimizer step.
        rank: this rank; None: the default process group's rank (0 without torch.distributed).
        shuffle: a new order each epoch (seeded by ``seed + epoch``); False: the dataset's order.
        seed: the shuffle's seed, the same on every rank.
        drop_last: drop an epoch's last global batch when its rows do not fill it; False pads
            it with rows from the epoch's start.

    Raises:
        ConfigError: as :func:`rank_shares`; ``num_rows`` < 1; or ``drop_last`` with fewer rows
            than one global batch (the epoch would be empty).
    """

    def __init__(
        self,
        num_rows: int,
        *,
        rank_micro_batch_sizes: Sequence[int],
        gradient_accumulation_steps: int,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._shares = rank_shares(rank_micro_batch_sizes, gradient_accumulation_steps, rank)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ConfigError(f"num_rows {num_rows!r} must be an int >= 1 (len(dataset))")
        self.global_batch_size = gradient_accumulation_steps * sum(rank_micro_batch_sizes)
        """Rows of one global batch: the effective batch size."""
        if drop_last and num_rows < self.global_batch_size:
            raise ConfigError(
                f"drop_last with {num_rows} rows, fewer than one global batch of "
                f"{self.global_batch_size}: the epoch would be empty; pass drop_last=False"
            )
        self.num_rows, self.rank = num_rows, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.num_global_batches = num_rows // self.global_batch_size
        else:
            self.num_global_batches = -(-num_rows // self.global_batch_size)

    @classmethod
    def from_plan(
        cls,
        num_rows: int,
        plan: Plan,
        *,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> MixedBatchSampler:
        """The sampler of ``plan`` (a mixed one, or a uniform one of equal micro-batches).

        Raises:
            ConfigError: a uniform plan of unequal micro-batches (use a ``DistributedSampler``
                and the Accumulator, which weights them); otherwise as the constructor.
        """
        sizes = plan.rank_micro_batch_sizes
        if sizes is None:
            if plan.uneven:
                raise ConfigError(
                    f"the plan's micro-batches differ in size ({list(plan.micro_batch_sizes)}) "
                    "from step to step, which MixedBatchSampler does not cut; use a "
                    "DistributedSampler with the Accumulator, or plan with uneven='never'"
                )
            sizes = (plan.micro_batch_size,) * plan.world_size
        return cls(
            num_rows,
            rank_micro_batch_sizes=sizes,
            gradient_accumulation_steps=plan.gradient_accumulation_steps,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order :meth:`__iter__` yields (call it on every rank)."""
        self.epoch = epoch

    def _order(self) -> list[int]:
        """The epoch's rows, in order, padded (from its start) to whole global batches."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        needed = self.num_global_batches * self.global_batch_size
        while len(order) < needed:
            order += order[: needed - len(order)]
        return order[:needed]

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for start in range(0, len(order), self.global_batch_size):
            for share in self._shares:
                yield [order[start + position] for position in share]

    def __len__(self) -> int:
        """Micro-batches this rank yields per epoch (the same on every rank)."""
        return self.num_global_batches * len(self._shares)
