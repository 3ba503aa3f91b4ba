"""``bench/mixed_ranks.py`` at a small size: on 2 and 4 ranks of simulated 80 GiB and 40 GiB
cards, the mixed plan meets the effective batch exactly, gives the larger card the larger
micro-batch, is within 5% of the best split by brute force and faster than the smallest-card
plan."""

from __future__ import annotations

import pytest

from bench.mixed_ranks import BIG, MIXES, QUICK_BATCHES, SMALL, brute_force, main, rows


def test_the_simulated_cards_differ_in_memory_and_speed() -> None:
    assert (BIG.max_micro_batch_size, SMALL.max_micro_batch_size) == (48, 17)
    assert all(BIG.line.seconds(m) < SMALL.line.seconds(m) for m in range(1, 49))


def test_mixed_is_near_brute_force_and_faster_than_the_smallest_card_plan() -> None:
    table = rows(QUICK_BATCHES)
    assert {len(MIXES[row.mix]) for row in table} == {2, 4}
    for row in table:
        steps, sizes, seconds = row.mixed
        cards = MIXES[row.mix]
        assert steps * sum(sizes) == row.effective_batch_size
        for card, size in zip(cards, sizes, strict=True):
            assert 1 <= size <= card.max_micro_batch_size
        big = [s for card, s in zip(cards, sizes, strict=True) if card is BIG]
        small = [s for card, s in zip(cards, sizes, strict=True) if card is SMALL]
        assert min(big) > max(small), row
        assert seconds <= 1.05 * row.brute[2], row
        assert seconds < row.uniform[2], row


def test_brute_force_finds_the_best_split_by_hand() -> None:
    # 24 on one card of each: one step of (17, 7) takes max(0.098, 0.0955) s; (16, 8) takes
    # 0.102 s, and two steps of (8, 4) 2 x 0.076 s.
    steps, sizes, seconds = brute_force((BIG, SMALL), 24)
    assert (steps, sizes) == (1, (17, 7))
    assert seconds == pytest.approx(0.098)


def test_the_bench_prints_its_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--quick"])
    out = capsys.readouterr().out
    assert "mixed/brute" in out and "uniform/mixed" in out
    assert out.rstrip().splitlines()[-1].startswith("worst mixed/brute 1.000; least uniform/mixed")
