"""``MixedBatchSampler``: each rank's share of every global batch, every row of a global batch on
exactly one rank, as many micro-batches on every rank, the order seeded by epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autobatch.errors import ConfigError
from autobatch.training import MixedBatchSampler, rank_shares
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
    num_batches = num_rows // effective if drop_last else -(-num_rows // effective)
    for rank, (sampler, micro_batches) in enumerate(zip(samplers, yielded, strict=True)):
        assert len(micro_batches) == len(sampler) == num_batches * steps
        assert {len(m) for m in micro_batches} == {plans[rank].micro_batch_size}
    seen = []
    for batch in range(num_batches):
        rows = [
            row
            for micro_batches in yielded
            for micro in micro_batches[batch * steps : (batch + 1) * steps]
            for row in micro
        ]
        assert len(rows) == len(set(rows)) == effective or num_rows < effective
        seen.extend(rows)
    if drop_last:
        assert len(set(seen)) == len(seen) == num_batches * effective
    else:  # every row of the epoch, padded from its start to whole global batches
        assert set(seen) == set(range(num_rows))
        assert len(seen) == num_batches * effective


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
