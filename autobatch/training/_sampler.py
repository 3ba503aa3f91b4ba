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
global batch trains that batch at its real size (:func:`short_batch_cuts`): as few micro-steps
as the micro-batches allow (``ceil(rows / sum(m_r))``, every rank the same number), each step's
rows cut over the ranks with at least one and at most ``m_r`` each. The Accumulator weights a
short last window by its real rows, so its gradient is still the exact mean over the rows it
holds. Only a last batch too small to give every rank a row in each of its micro-steps is padded
with rows from the epoch's start: fewer than ``world_size`` rows, at most what
``DistributedSampler`` pads. So 1,000 rows under ``[36, 12] x 2 = 96`` train 1,000 rows, each
once (ten global batches of 96, then one of 40: 30 and 10 rows), and 10 rows one step of 10.
``drop_last=True`` drops that batch instead (every optimizer step then sees exactly the
effective batch of distinct rows).

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

__all__ = ["MixedBatchSampler", "rank_shares", "short_batch_cuts"]


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


def short_batch_cuts(rank_micro_batch_sizes: Sequence[int], num_rows: int) -> list[list[int]]:
    """How a last global batch of ``num_rows`` rows (fewer than one global batch) is cut: per
    micro-step, the rows of each rank, in rank order.

    As few micro-steps as the micro-batches allow (``ceil(num_rows / sum(m_r))``), the rows
    spread evenly over them; each step's rows go one to every rank, the rest in proportion to
    what each rank's micro-batch holds beyond one (never more than ``m_r``). A batch with fewer
    rows than that gives every rank a row in every step is padded up to it: fewer than
    ``len(rank_micro_batch_sizes)`` rows (the cuts then sum to more than ``num_rows``).

    Args:
        rank_micro_batch_sizes: every rank's micro-batch, rows, each >= 1, in rank order.
        num_rows: the batch's rows, >= 1.

    Returns:
        One list per micro-step of one row count per rank, e.g. ``[[30, 10]]`` for 40 rows over
        ``[36, 12]``.
    """
    sizes = list(rank_micro_batch_sizes)
    per_step, ranks = sum(sizes), len(sizes)
    steps = -(-num_rows // per_step)
    rows = max(num_rows, steps * ranks)  # a row for every rank in every step
    spare = [size - 1 for size in sizes]
    cuts = []
    for step in range(steps):
        here = rows // steps + (step < rows % steps)
        extra = here - ranks  # 0 <= extra <= sum(spare)
        if not extra:
            cuts.append([1] * ranks)
            continue
        counts = [1 + extra * room // sum(spare) for room in spare]
        # The rows the floors left go to the largest remainders (the lower rank on a tie).
        by_remainder = sorted(range(ranks), key=lambda r: (-(extra * spare[r] % sum(spare)), r))
        for rank in by_remainder[: here - sum(counts)]:
            counts[rank] += 1
        cuts.append(counts)
    return cuts


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
        drop_last: drop an epoch's last global batch when its rows do not fill it; False
            trains it at its real size (:func:`short_batch_cuts`: fewer micro-steps, smaller
            micro-batches, padded by fewer than ``world_size`` rows only when it has too few
            rows for every rank to get one in each of its steps).

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
        self._full_batches, left = divmod(num_rows, self.global_batch_size)
        self._last_shares: list[range] = []
        self.rows_per_epoch = self._full_batches * self.global_batch_size
        """Rows the ranks train per epoch, all ranks together: ``num_rows`` (less the dropped
        last batch with ``drop_last``; plus fewer than ``world_size`` rows of padding when the
        last batch has too few rows for every rank to get one)."""
        if left and not drop_last:
            cuts = short_batch_cuts(rank_micro_batch_sizes, left)
            start = 0
            for counts in cuts:
                offset = start + sum(counts[:rank])
                self._last_shares.append(range(offset, offset + counts[rank]))
                start += sum(counts)
            self.rows_per_epoch += start
        self.num_global_batches = self._full_batches + bool(self._last_shares)
        """Optimizer steps per epoch: the whole global batches, and a short last one."""

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
        """The epoch's rows, in order, padded (from its start) to :attr:`rows_per_epoch`."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        needed = self.rows_per_epoch
        while len(order) < needed:
            order += order[: needed - len(order)]
        return order[:needed]

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for batch in range(self._full_batches):
            start = batch * self.global_batch_size
            for share in self._shares:
                yield [order[start + position] for position in share]
        start = self._full_batches * self.global_batch_size
        for share in self._last_shares:
            yield [order[start + position] for position in share]

    def __len__(self) -> int:
        """Micro-batches this rank yields per epoch (the same on every rank)."""
        return self._full_batches * len(self._shares) + len(self._last_shares)
