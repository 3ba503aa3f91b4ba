"""``MixedBatchSampler``: each rank's share of every global batch, every row of a global batch on
exactly one rank, as many micro-batches on every rank, the order seeded by epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autobatch.errors import ConfigError
from autobatch.training import MixedBatchSampler, rank_shares
from autobatch.training._sampler import short_batch_cuts
from tests.planning.test_mixed import mixed
from tests.planning.test_planner import plan


def test_rank_shares_cut_each_micro_step_in_rank_order() -> None:
    assert rank_shares([3, 1, 2], 2, 0) == [range(0, 3), range(6, 9)]
    assert rank_shares([3, 1, 2], 2, 1) == [range(3, 4), range(9, 10)]
    assert rank_shares([3, 1, 2], 2, 2) == [range(4, 6), range(10, 12)]


@pytest.mark.parametrize(
    ("sizes", "steps", "rank", "match"),
    [
        ([], 1, 0, r"rank_micro_batch_sizes \[\] must be one int >= 1 per rank"),
        ([3, 0], 1, 0, r"rank_micro_batch_sizes \[3, 0\] must be one int >= 1"),
        ([3, 1], 0, 0, "gradient_accumulation_steps 0 must be an int >= 1"),
        ([3, 1], 1, 2, r"rank 2 must be in \[0, 2\)"),
    ],
)
def test_rank_shares_refuse_bad_input(sizes: list[int], steps: int, rank: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        rank_shares(sizes, steps, rank)


@pytest.mark.parametrize(
    ("maxima", "effective", "num_rows"),
    [([48, 17], 96, 200), ([48, 48, 17, 17], 200, 600), ([9, 30, 5], 60, 59)],
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_row_of_a_global_batch_goes_to_exactly_one_rank(
    maxima: list[int], effective: int, num_rows: int, drop_last: bool
) -> None:
    plans = mixed(maxima, effective_batch_size=effective)
    steps = plans[0].gradient_accumulation_steps
    if drop_last and num_rows < effective:
        with pytest.raises(ConfigError, match="the epoch would be empty"):
            MixedBatchSampler.from_plan(num_rows, plans[0], rank=0, drop_last=True)
        return
    samplers = [
        MixedBatchSampler.from_plan(num_rows, p, rank=r, seed=5, drop_last=drop_last)
        for r, p in enumerate(plans)
    ]
    for sampler in samplers:
        sampler.set_epoch(2)
    yielded = [list(s) for s in samplers]
    full = num_rows // effective
    for rank, (sampler, micro_batches) in enumerate(zip(samplers, yielded, strict=True)):
        assert len(micro_batches) == len(sampler) == len(yielded[0])
        whole = {len(m) for m in micro_batches[: full * steps]}
        assert whole == ({plans[rank].micro_batch_size} if full else set())
        assert all(1 <= len(m) <= plans[rank].micro_batch_size for m in micro_batches)
    seen = []
    for batch in range(full):
        rows = [
            row
            for micro_batches in yielded
            for micro in micro_batches[batch * steps : (batch + 1) * steps]
            for row in micro
        ]
        assert len(rows) == len(set(rows)) == effective
        seen.extend(rows)
    seen.extend(
        row for micro_batches in yielded for m in micro_batches[full * steps :] for row in m
    )
    if drop_last:
        assert len(set(seen)) == len(seen) == full * effective
    else:  # every row of the epoch once: the last global batch is short, not padded
        assert sorted(seen) == list(range(num_rows))
        assert samplers[0].rows_per_epoch == num_rows


def _epoch(num_rows: int, sizes: list[int], steps: int) -> list[list[list[int]]]:
    """Every rank's micro-batches of one epoch, in rank order."""
    return [
        list(
            MixedBatchSampler(
                num_rows, rank_micro_batch_sizes=sizes, gradient_accumulation_steps=steps, rank=r
            )
        )
        for r in range(len(sizes))
    ]


@pytest.mark.parametrize(
    ("num_rows", "micro_batches", "last_rows"),
    [
        (1000, 21, [[30, 10]]),  # 10 x 96, then one micro-step of 40 rows
        (10, 1, [[7, 3]]),  # one optimizer step of the 10 rows, not 96
        (960, 20, []),  # a multiple of 96: no short batch
        (1040, 22, [[30, 10], [30, 10]]),  # 80 rows > 48: two micro-steps of 40
    ],
)
def test_the_short_last_global_batch_trains_its_rows_once_at_their_real_size(
    num_rows: int, micro_batches: int, last_rows: list[list[int]]
) -> None:
    """[36, 12] x 2 = 96, without drop_last: each row of the epoch trained exactly once."""
    ranks = _epoch(num_rows, [36, 12], 2)
    assert [len(r) for r in ranks] == [micro_batches, micro_batches]
    full = num_rows // 96 * 2
    assert [[len(m) for m in r[full:]] for r in ranks] == [
        [step[rank] for step in last_rows] for rank in range(2)
    ]
    rows = [row for r in ranks for m in r for row in m]
    assert sorted(rows) == list(range(num_rows))  # 1,000 rows: 1,000 trained, none twice
    last_step = [m for r in ranks for m in r[full:]]
    assert sum(map(len, last_step)) == num_rows % 96


def test_a_last_batch_with_fewer_rows_than_ranks_pads_fewer_than_world_size() -> None:
    ranks = _epoch(2, [3, 1, 2, 5], 4)  # 2 rows for 4 ranks: each rank needs a row
    assert [[len(m) for m in r] for r in ranks] == [[1], [1], [1], [1]]
    rows = sorted(row for r in ranks for m in r for row in m)
    assert rows == [0, 0, 1, 1]  # 2 padded rows (< 4 ranks), each row at most once more
    sampler = MixedBatchSampler(
        2, rank_micro_batch_sizes=[3, 1, 2, 5], gradient_accumulation_steps=4
    )
    assert sampler.rows_per_epoch == 4
    assert sampler.num_global_batches == 1


@pytest.mark.parametrize(
    ("sizes", "num_rows", "cuts"),
    [
        ([36, 12], 40, [[30, 10]]),
        ([36, 12], 10, [[7, 3]]),
        ([36, 12], 1, [[1, 1]]),  # padded by one row: every rank trains in the step
        ([1, 1], 3, [[1, 1], [1, 1]]),  # 2 steps need 4 rows: padded by one (< 2 ranks)
        ([1, 1, 1], 5, [[1, 1, 1], [1, 1, 1]]),
        ([4, 2], 11, [[4, 2], [3, 2]]),
        ([5, 5, 5], 14, [[5, 5, 4]]),
    ],
)
def test_short_batch_cuts_stay_within_each_ranks_micro_batch(
    sizes: list[int], num_rows: int, cuts: list[list[int]]
) -> None:
    got = short_batch_cuts(sizes, num_rows)
    assert got == cuts
    padded = sum(map(sum, got)) - num_rows
    assert 0 <= padded < len(sizes)
    assert all(1 <= c <= m for step in got for c, m in zip(step, sizes, strict=True))


def test_the_order_is_seeded_by_epoch_and_the_same_on_every_rank() -> None:
    plans = mixed([48, 17], effective_batch_size=96)
    first = MixedBatchSampler.from_plan(192, plans[0], rank=0, seed=1)
    again = MixedBatchSampler.from_plan(192, plans[0], rank=0, seed=1)
    assert list(first) == list(again)
    first.set_epoch(1)
    assert list(first) != list(again)
    ordered = MixedBatchSampler.from_plan(192, plans[1], rank=1, shuffle=False)
    size = plans[0].micro_batch_size
    assert next(iter(ordered)) == list(range(size, 48))  # rank 1's rows after rank 0's


def test_a_data_loader_yields_the_shares_and_a_uniform_plan_is_cut_alike() -> None:
    data = TensorDataset(torch.arange(64))
    uniform = plan(16, effective_batch_size=64, world_size=2)  # 16 x 2 on each of 2 ranks
    loader = DataLoader(
        data, batch_sampler=MixedBatchSampler.from_plan(64, uniform, rank=1, shuffle=False)
    )
    assert [batch[0].tolist() for batch in loader] == [
        list(range(16, 32)),
        list(range(48, 64)),
    ]
    uneven = plan(24, effective_batch_size=97, uneven="always")
    with pytest.raises(ConfigError, match="differ in size"):
        MixedBatchSampler.from_plan(97, uneven, rank=0)
    with pytest.raises(ConfigError, match="num_rows 0 must be an int >= 1"):
        MixedBatchSampler.from_plan(0, uniform, rank=0)
