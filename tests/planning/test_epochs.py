"""A plan over one epoch of data (``Plan.with_epoch``): micro-batches and optimizer steps per
epoch per rank, and the effective batch the epoch's last step really reaches."""

from __future__ import annotations

from typing import Any

import pytest

from autobatch.errors import ConfigError
from autobatch.planning import Plan
from autobatch.planning._epochs import EpochPlan
from tests.planning.test_planner import plan


def simulate(rows_per_rank: int, sizes: tuple[int, ...], drop_last: bool) -> list[list[int]]:
    """The epoch as a loader and a framework run it: micro-batches of the window's sizes in
    order, an incomplete last one unless dropped, grouped into windows of len(sizes)."""
    batches, left, index = [], rows_per_rank, 0
    while left > 0:
        size = sizes[index % len(sizes)]
        if left < size and drop_last:
            break
        batches.append(min(size, left))
        left -= batches[-1]
        index += 1
    k = len(sizes)
    return [batches[i : i + k] for i in range(0, len(batches), k)]


@pytest.mark.parametrize(
    ("num_rows", "limit", "effective", "world_size", "drop_last", "last"),
    [
        (96, 16, 48, 1, False, 48),  # two whole steps of 3 x 16
        (64, 16, 48, 1, False, 16),  # 4 micro-batches: the second step has one
        (70, 16, 48, 1, False, 22),  # 4 of 16 and a partial 6: the second step has 16 + 6
        (70, 16, 48, 1, True, 16),  # the partial micro-batch dropped
        (100, 10, 40, 2, False, 20),  # 50 rows a rank: 5 micro-batches of 10, k = 2
        (8, 16, 48, 1, True, 0),  # not one whole micro-batch: no step at all
        (125, 8, 256, 1, False, 125),  # an epoch shorter than one step (8 x 32)
        (97 * 3, 24, 97, 1, False, 97),  # unequal sizes (20, 20, 19, 19, 19): 3 whole steps
        (200, 24, 97, 1, False, 6),  # 2 steps of 97, then 6 rows
    ],
)
def test_epoch_numbers_match_a_simulated_epoch(
    num_rows: int, limit: int, effective: int, world_size: int, drop_last: bool, last: int
) -> None:
    p = plan(limit, effective_batch_size=effective, world_size=world_size)
    epoch = p.with_epoch(num_rows, drop_last=drop_last).epoch
    assert epoch is not None
    assert epoch.last_effective_batch_size == last
    windows = simulate(-(-num_rows // world_size), p.micro_batch_sizes, drop_last)
    assert epoch.num_optimizer_steps == len(windows)
    assert epoch.num_micro_batches_per_rank == sum(len(w) for w in windows)
    assert epoch.num_full_steps == sum(sum(w) * world_size == effective for w in windows)
    assert epoch.last_step_micro_batches == (len(windows[-1]) if windows else 0)
    assert epoch.last_effective_batch_size == (sum(windows[-1]) * world_size if windows else 0)


def test_an_epoch_shorter_than_one_step_says_every_step_falls_short() -> None:
    # Lightning with 125 rows, E = 256 as 8 x 32 on one rank: the one step of each epoch sees
    # 125 samples, not the 256 of a full step, and the plan says so.
    p = plan(8, effective_batch_size=256).with_epoch(125)
    assert p.epoch == EpochPlan(
        num_rows_per_rank=125,
        drop_last=False,
        num_micro_batches_per_rank=16,
        num_optimizer_steps=1,
        num_full_steps=0,
        last_step_micro_batches=16,
        last_effective_batch_size=125,
    )
    assert not p.epoch.fills_every_step
    assert p.notes[-1] == (
        "an epoch is 16 micro-batches per rank (125 rows), 1 optimizer step(s): the epoch "
        "cannot fill one window of the plan, so every step reaches an effective batch of 125, "
        "not 256"
    )


class Sampler:
    """A sampler's face: its length is this rank's rows (as a DistributedSampler's)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows


class Loader:
    """A DataLoader's face: ``sampler``, ``batch_size``, ``drop_last``."""

    def __init__(self, rows: int, batch_size: int | None, drop_last: bool = False) -> None:
        self.sampler = Sampler(rows)
        self.batch_size = batch_size
        self.drop_last = drop_last


def test_a_sampler_or_a_loader_gives_this_ranks_rows() -> None:
    p = plan(16, effective_batch_size=128, world_size=2)  # 16 x 4 per rank
    by_rows = p.with_epoch(1000).epoch  # 500 rows a rank
    assert by_rows is not None and by_rows.num_rows_per_rank == 500
    assert p.with_epoch(Sampler(500)).epoch == by_rows
    assert p.with_epoch(Loader(500, 16)).epoch == by_rows
    dropped = p.with_epoch(Loader(500, 16, drop_last=True)).epoch
    assert dropped is not None and dropped.drop_last and dropped.num_micro_batches_per_rank == 31


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (-1, r"the rows of an epoch must be an int >= 0, got -1"),
        (True, r"must be an int >= 0, got True"),
        (Loader(100, 8), r"micro-batches of 8 rows, but the plan's are 16"),
        (object(), r"has no len\(\).*pass the number of rows"),
    ],
)
def test_data_without_rows_is_refused(data: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(16, effective_batch_size=64).with_epoch(data)


def test_the_epoch_travels_in_the_plans_dict() -> None:
    p = plan(16, effective_batch_size=128, world_size=2).with_epoch(1000)
    assert Plan.from_dict(p.to_dict()) == p
    assert p.to_dict()["epoch"]["num_optimizer_steps"] == 8
    assert Plan.from_dict({**p.to_dict(), "epoch": None}).epoch is None
