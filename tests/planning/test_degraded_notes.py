"""A plan the constraints degraded (equal sizes of a prime, ``multiple_of``) says so: the split
it took, the fewest steps the limit allows, and the ways back, on every surface in its words."""

from __future__ import annotations

import pytest

from tests.planning.test_planner import plan

PRIME = (
    "degraded split: equal micro-batches (97 is prime) split 97 samples per rank only as 97 "
    "accumulation steps of 1, where 5 steps of at most 24 would do; use {uneven} (5 steps of 20 "
    "and 19, losses weighted by size), or an effective batch size that splits well: 95 (5 steps "
    "of 19) or 100 (5 steps of 20)"
)


def degraded(notes: tuple[str, ...] | list[str]) -> list[str]:
    return [note for note in notes if note.startswith("degraded split")]


def test_equal_sizes_of_a_prime_note_the_split_and_the_ways_back() -> None:
    result = plan(24, effective_batch_size=97, uneven="never")
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == (1, 97)
    assert degraded(result.notes) == [PRIME.format(uneven="uneven='auto'")]


def test_multiple_of_notes_the_nearest_batches_per_rank_times_the_ranks() -> None:
    result = plan(24, effective_batch_size=208, world_size=2, multiple_of=8)
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == (8, 13)
    assert degraded(result.notes) == [
        "degraded split: micro-batches that are multiples of 8 split 104 samples per rank only "
        "as 13 accumulation steps of 8, where 5 steps of at most 24 would do; use an effective "
        "batch size that splits well: 160 (5 steps of 16) or 240 (5 steps of 24)"
    ]


@pytest.mark.parametrize(
    ("fields", "split"),
    [
        ({"effective_batch_size": 97}, (20, 5)),  # auto: unequal, the fewest steps
        ({"effective_batch_size": 98}, (14, 7)),  # auto's equal split, within twice the fewest
        ({"effective_batch_size": 96, "uneven": "never"}, (24, 4)),
    ],
)
def test_a_plan_within_twice_the_fewest_steps_is_not_degraded(
    fields: dict[str, object], split: tuple[int, int]
) -> None:
    result = plan(24, **fields)
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == split
    assert degraded(result.notes) == []
