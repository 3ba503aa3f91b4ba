"""activation_checkpointing="auto" tried "selective" and "full" exactly when the plain plan's
time per sample was not measured, yet choose_checkpointing keeps "the least recompute that fits"
whenever an eligible mode is untimed, i.e. always "none" while the plain plan is untimed: the
extra probes could not change the answer. Now the two agree: the tuning road times each plan's
own micro-batch (tests/test_tuning_checkpointing.py), and a plain plan still untimed tries
nothing, for no mode could be shown faster."""

from autobatch.planning import ModeMeasurement, checkpointing_modes_to_try, choose_checkpointing

MiB = 2**20


def _plain(seconds: float | None) -> ModeMeasurement:
    return ModeMeasurement(
        mode="none", max_micro_batch_size=5, micro_batch_size=4, gradient_accumulation_steps=16,
        seconds_per_optimizer_step=seconds, peak_memory_bytes={5: 90 * MiB}, num_trials=4,
    )  # fmt: skip


FULL = ModeMeasurement(
    mode="full", max_micro_batch_size=22, micro_batch_size=16, gradient_accumulation_steps=4,
    seconds_per_optimizer_step=1.0, peak_memory_bytes={5: 30 * MiB, 22: 90 * MiB}, num_trials=4,
)  # fmt: skip


def test_modes_auto_tries_can_be_chosen() -> None:
    plain = _plain(None)
    modes, why = checkpointing_modes_to_try(plain, {5: 0.5})  # what that probe measured
    if modes:  # tried: then what they measure must be able to win
        choice = choose_checkpointing([plain, FULL])
        assert choice is not None and choice.mode == "full", choice
    assert modes == ()
    assert "no measured step time" in why


def test_a_timed_plain_plan_tries_the_modes_and_the_faster_one_wins() -> None:
    plain = _plain(32.0)  # 0.5 s per sample at micro-batch 4, measured, x 64 samples
    modes, why = checkpointing_modes_to_try(plain, {4: 0.5, 5: 0.5})
    assert modes == ("selective", "full"), why
    assert "not measured at two sizes up to micro-batch 4" in why
    choice = choose_checkpointing([plain, FULL])
    assert choice is not None and choice.mode == "full", choice.reason
    assert choice.considered[0].startswith("none: micro-batch 4 \u00d7 16 steps, 32 s per")
