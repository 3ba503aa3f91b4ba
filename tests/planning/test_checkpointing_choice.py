"""The pure choice of activation checkpointing (:mod:`autobatch.planning._checkpointing`) on
made-up measurements: which modes are worth probing, and which mode wins."""

from __future__ import annotations

import pytest

from autobatch.errors import ConfigError
from autobatch.planning import (
    ModeMeasurement,
    checkpointing_modes_to_try,
    choose_checkpointing,
    timing_noise,
)
from autobatch.profile import Trial


def _mode(
    mode: str,
    size: int | None,
    steps: int | None,
    seconds: float | None,
    *,
    largest: int | None = None,
    peaks: dict[int, int] | None = None,
) -> ModeMeasurement:
    return ModeMeasurement(
        mode=mode,
        max_micro_batch_size=largest if largest is not None else (size or 0),
        micro_batch_size=size,
        gradient_accumulation_steps=steps,
        seconds_per_optimizer_step=seconds,
        peak_memory_bytes=peaks or {},
        num_trials=5,
    )


PLAIN = _mode("none", 8, 8, 4.0, peaks={4: 500, 8: 900})


def test_the_fastest_plan_wins() -> None:
    full = _mode("full", 64, 1, 3.0, peaks={8: 300, 64: 950})
    selective = _mode("selective", 32, 2, 3.5, peaks={8: 600, 32: 940})
    choice = choose_checkpointing([PLAIN, selective, full])
    assert choice is not None
    assert choice.mode == "full"
    assert choice.reason == "the least time per optimizer step (3 s)"
    assert choice.considered[0].startswith("none: micro-batch 8 \u00d7 8 steps, 4 s per")


def test_a_difference_within_the_noise_goes_to_the_least_recompute() -> None:
    full = _mode("full", 64, 1, 3.9, peaks={8: 300})
    choice = choose_checkpointing([PLAIN, full])
    assert choice is not None
    assert choice.mode == "none"
    assert "within 5% of the fastest (full, 3.9 s against 4 s)" in choice.reason
    selective = _mode("selective", 32, 2, 3.0, peaks={8: 600})
    choice = choose_checkpointing([PLAIN, selective, _mode("full", 64, 1, 2.95, peaks={8: 300})])
    assert choice is not None
    assert choice.mode == "selective"


def test_a_mode_whose_peak_is_not_below_the_plain_one_is_never_chosen() -> None:
    # Faster on paper, but its measured peak at micro-batch 8 is the plain one's or above.
    raised = _mode("full", 64, 1, 1.0, peaks={8: 950})
    choice = choose_checkpointing([PLAIN, raised])
    assert choice is not None
    assert choice.mode == "none"
    assert (
        "full: left out, its measured peak memory at micro-batch 8 (950 B) is not below"
        in (choice.considered[1])
    )
    no_gain = _mode("selective", 8, 8, 1.0)  # no common size; not a larger micro-batch either
    choice = choose_checkpointing([PLAIN, no_gain])
    assert choice is not None
    assert choice.mode == "none"


def test_when_nothing_fits_plain_the_checkpointed_plan_is_chosen() -> None:
    plain = _mode("none", None, None, None, largest=0)
    full = _mode("full", 2, 16, 8.0, peaks={1: 100, 2: 180})
    choice = choose_checkpointing([plain, _mode("selective", None, None, None), full])
    assert choice is not None
    assert choice.mode == "full"
    assert choice.considered[0] == "none: no plan (largest micro-batch 0)"
    assert choose_checkpointing([plain]) is None


def test_missing_timings_choose_the_least_recompute_that_fits() -> None:
    plain = _mode("none", 8, 8, None, peaks={8: 900})
    full = _mode("full", 64, 1, 2.0, peaks={8: 300})
    choice = choose_checkpointing([full, plain])
    assert choice is not None
    assert choice.mode == "none"
    assert "not measured" in choice.reason


def test_modes_are_skipped_when_time_per_sample_stopped_falling() -> None:
    modes, why = checkpointing_modes_to_try(PLAIN, {1: 0.5, 2: 0.3, 4: 0.2, 8: 0.195})
    assert modes == ()
    assert why.startswith("time per sample stopped falling without checkpointing: 0.195 s at ")
    assert "against 0.2 s at 4 (measured)" in why


def test_modes_are_tried_while_time_per_sample_still_falls() -> None:
    modes, why = checkpointing_modes_to_try(PLAIN, {1: 0.5, 2: 0.3, 4: 0.2, 8: 0.15})
    assert modes == ("selective", "full")
    assert "still falls" in why
    modes, why = checkpointing_modes_to_try(PLAIN, {8: 0.15})
    assert modes == ("selective", "full")
    assert "not measured at two sizes" in why


def test_one_micro_step_or_no_fit_decide_at_once() -> None:
    one_step = _mode("none", 64, 1, 1.0)
    modes, why = checkpointing_modes_to_try(one_step, {32: 1.0, 64: 0.5})
    assert modes == ()
    assert "in one micro-step (micro-batch 64)" in why
    modes, why = checkpointing_modes_to_try(_mode("none", None, None, None, largest=0), {})
    assert modes == ("selective", "full")
    assert why == "no micro-batch fits without checkpointing"


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="mode='most' is not a mode; give one of 'none'"):
        _mode("most", 1, 1, 1.0)


def test_more_recompute_for_no_larger_micro_batch_is_never_chosen() -> None:
    # Timed faster (noise: the same micro-batch cannot be faster with recompute added).
    selective = _mode("selective", 8, 8, 2.0, peaks={8: 700})
    full = _mode("full", 16, 4, 3.0, peaks={8: 400})
    choice = choose_checkpointing([PLAIN, selective, full])
    assert choice is not None
    assert choice.mode == "full"
    assert choice.considered[1] == (
        "selective: left out, its plan's micro-batch 8 is no larger than none's (8): "
        "only more recompute"
    )


def _noisy(mode: ModeMeasurement, noise: float) -> ModeMeasurement:
    return ModeMeasurement(
        mode=mode.mode,
        max_micro_batch_size=mode.max_micro_batch_size,
        micro_batch_size=mode.micro_batch_size,
        gradient_accumulation_steps=mode.gradient_accumulation_steps,
        seconds_per_optimizer_step=mode.seconds_per_optimizer_step,
        seconds_noise=noise,
        peak_memory_bytes=mode.peak_memory_bytes,
        num_trials=mode.num_trials,
    )


def test_a_difference_within_the_measured_noise_goes_to_the_least_recompute() -> None:
    # full is 20% faster (3.2 s against 4 s), but the plain time's steps spread by 30%.
    full = _noisy(_mode("full", 64, 1, 3.2, peaks={8: 300}), 0.03)
    choice = choose_checkpointing([_noisy(PLAIN, 0.30), full])
    assert choice is not None
    assert choice.mode == "none"
    assert (
        "within the measured noise of 30% of the fastest (full, 3.2 s against 4 s)" in choice.reason
    )
    assert choice.considered[0].endswith(
        "4 s per optimizer step, measured noise 30% (largest micro-batch 8, 5 trials)"
    )


def test_a_difference_beyond_the_measured_noise_wins() -> None:
    full = _noisy(_mode("full", 64, 1, 3.2, peaks={8: 300}), 0.03)
    choice = choose_checkpointing([_noisy(PLAIN, 0.03), full])
    assert choice is not None
    assert choice.mode == "full"
    assert choice.reason == "the least time per optimizer step (3.2 s)"


def test_without_a_measured_spread_the_five_percent_rule_decides() -> None:
    # Older profiles (one step per size) record no spread: 20% faster wins, 4% does not.
    choice = choose_checkpointing([PLAIN, _mode("full", 64, 1, 3.2, peaks={8: 300})])
    assert choice is not None and choice.mode == "full"
    choice = choose_checkpointing([PLAIN, _mode("full", 64, 1, 3.85, peaks={8: 300})])
    assert choice is not None and choice.mode == "none"
    assert "within 5% of the fastest (full, 3.85 s against 4 s)" in choice.reason


def test_a_negative_noise_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"seconds_noise=-0.1 must be a fraction >= 0"):
        _noisy(PLAIN, -0.1)


def _timed(size: int, seconds: float, **flags: bool) -> Trial:
    return Trial(micro_batch_size=size, fits=True, step_seconds=seconds, **flags)


def test_the_noise_is_the_median_over_the_fastest_of_the_steps_at_the_size() -> None:
    trials = (
        _timed(1, 9.0, warm_up=True),  # the warm-up is not a timed step
        _timed(8, 2.0),
        _timed(8, 3.0, repeat=True),
        _timed(8, 9.0, repeat=True),  # one disturbed step moves the median only so far
        _timed(4, 1.0),  # another size
    )
    assert timing_noise(trials, 8) == pytest.approx(0.5)


def test_fewer_than_two_timed_steps_have_no_noise() -> None:
    failed = Trial(micro_batch_size=8, fits=False, oom=True, step_seconds=5.0)
    assert timing_noise((_timed(8, 2.0), failed, _timed(8, 0.0, repeat=True)), 8) == 0.0
    assert timing_noise((), 8) == 0.0
