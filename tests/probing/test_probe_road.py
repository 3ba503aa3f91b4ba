"""The probe's road by cost: the estimate runs only where it saves more real-step time than it
costs, and the profile records where the time went. The simulated device's clock counts each
real step at ``step_seconds``, and where a fake step's length decides the road the probe's clock
(``ProbeOptions.clock``) advances by a set amount per step, so each regime is exact here, not
timed on a machine that may be loaded."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from autobatch import probe
from autobatch.device._cpu import CpuDevice
from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError
from autobatch.probing._batch import BatchSource
from autobatch.probing._estimator import FakeStep, estimate_points
from autobatch.probing._options import ProbeOptions, StepSpec
from autobatch.probing._probe_run import (
    ESTIMATE_OVERRUN,
    EXPECTED_FAKE_STEPS,
    FAKE_STEP_SECONDS_PER_TENSOR,
)
from autobatch.probing._prober import run_probe
from autobatch.probing._search import estimate_budget_seconds, growth_sizes
from autobatch.profile import MemoryModel, ProbeTimings, Profile
from tests.helpers.clocks import SetClock

MIB = 2**20


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


SAMPLE = (torch.randn(4, 32), torch.randint(0, 10, (4,)))


def run(step_seconds: float | None) -> Profile:
    device = SimulatedDevice(capacity_bytes=4 * MIB, step_seconds=step_seconds)
    return probe(mlp(), SAMPLE, loss_fn=F.cross_entropy, device=device)


class Ticking(torch.nn.Module):
    """Identity whose forward advances ``clock`` by ``seconds``: a step (one forward) then
    lasts exactly ``seconds`` on that clock, however loaded the machine is."""

    def __init__(self, clock: SetClock, seconds: float) -> None:
        super().__init__()
        self.clock = clock
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.seconds)
        return x


def run_timed(step_seconds: float, fake_step_seconds: float) -> Profile:
    """:func:`run`'s probe with each real step at ``step_seconds`` on the simulated device's
    clock and each fake step at ``fake_step_seconds`` on the probe's."""
    clock = SetClock()
    model = torch.nn.Sequential(Ticking(clock, fake_step_seconds), mlp())
    step = StepSpec.build(model, SAMPLE, loss_fn=F.cross_entropy)
    device = SimulatedDevice(capacity_bytes=4 * MIB, step_seconds=step_seconds)
    return run_probe(step, ProbeOptions.build(step, device=device, clock=clock))


def test_where_real_steps_are_dear_the_estimate_runs_and_four_steps_confirm_it() -> None:
    # dear real steps: 10 s each on a set clock; the estimate may spend two of them, 20 s
    profile = run(10.0)
    assert profile.method == "probe"
    assert profile.num_trials == 4 and profile.num_ooms == 1  # warm-up, n, n + 1, n again
    timings = profile.timings
    assert timings is not None and timings.clock == "simulated"
    assert len(timings.fake_step_seconds) >= 3  # the fake warm-up, 1, 64, ...
    assert timings.estimate_seconds >= sum(timings.fake_step_seconds) > 0
    assert timings.trial_seconds == pytest.approx((10.0,) * 4, abs=0.5)
    assert timings.cleanup_seconds[2] > 0 and timings.cleanup_seconds[:2] == (0.0, 0.0)
    assert timings.total_seconds >= timings.estimate_seconds + timings.real_seconds
    assert not any("estimate not run" in note for note in profile.notes)


def test_where_real_steps_are_cheap_the_search_runs_on_real_steps_alone() -> None:
    # a GPU: a microsecond a real step; the two it saves cost far less than one fake step
    profile = run(1e-6)
    fresh = run(10.0)
    assert profile.method == "doubling"
    assert profile.max_micro_batch_size == fresh.max_micro_batch_size  # the same exact max
    timings = profile.timings
    assert timings is not None
    assert timings.estimate_seconds == 0 and timings.fake_step_seconds == ()
    assert len(timings.trial_seconds) == profile.num_trials
    note = next(n for n in profile.notes if n.startswith("estimate not run"))
    predicted = EXPECTED_FAKE_STEPS * FAKE_STEP_SECONDS_PER_TENSOR * 4  # 4 parameter tensors
    assert f"{predicted:.3g} s" in note and "searched with real steps" in note


def test_without_an_estimate_a_well_behaved_model_takes_one_oom() -> None:
    # The line from the resident bytes through the warm-up's peak (the optimizer step's: its max,
    # 35, is low), then from those bytes through 35's peak (1111, a max no larger than the true
    # one), then the secant through two measured peaks: one above its max fails.
    profile = run(1e-6)
    assert profile.method == "doubling"  # no estimate ran
    assert [t.micro_batch_size for t in profile.trials] == [1, 35, 1111, 1262, 1261, 1261]
    assert profile.num_ooms == 1 and profile.max_micro_batch_size == 1261


def test_the_rule_is_the_real_steps_the_estimate_saves() -> None:
    # without an estimate the search from the warm-up runs two sizes before two measured peaks
    # give it a line (where both fit): the warm-up line's max and one above, where that line
    # predicts a max under the limit; else the search from what ran's first two
    line = MemoryModel(fixed_bytes=1_000, bytes_per_sample=100)
    assert growth_sizes(65536, capacity_bytes=10_900, line=line) == (99, 100)
    assert estimate_budget_seconds(
        limit=65536,
        real_step_seconds=0.5,
        steps_scale_with_size=True,
        capacity_bytes=10_900,
        line=line,
    ) == pytest.approx(99.5)
    assert growth_sizes(65536) == (4049, 24311) and growth_sizes(10) == (4, 5)
    assert growth_sizes(3) == (2, 3) and growth_sizes(2) == (2,) and growth_sizes(1) == ()
    # a step's time stays near the warm-up's (a GPU, a set cost): two steps
    assert estimate_budget_seconds(
        limit=65536, real_step_seconds=0.5, steps_scale_with_size=False
    ) == pytest.approx(1.0)
    # it grows with the size (a CPU): 4049 + 24311 warm-up steps
    assert estimate_budget_seconds(
        limit=65536, real_step_seconds=0.5, steps_scale_with_size=True
    ) == pytest.approx(14_180.0)
    assert estimate_budget_seconds(limit=1, real_step_seconds=0.5, steps_scale_with_size=True) == 0


def test_devices_say_whether_a_step_s_time_grows_with_its_size() -> None:
    assert CpuDevice().steps_scale_with_size
    assert SimulatedDevice(capacity_bytes=MIB, step_seconds=None).steps_scale_with_size
    assert not SimulatedDevice(capacity_bytes=MIB, step_seconds=0.1).steps_scale_with_size


def test_a_started_estimate_may_overrun_its_prediction_to_reach_the_boundary() -> None:
    # 0.1 s a real step: the estimate may save 0.2 s; its predicted 0.144 s (6 fake steps of
    # 4 tensors) starts it. Its fake steps take 0.04 s each, so it overruns both its prediction
    # and the 0.2 s, yet stays within ESTIMATE_OVERRUN x 0.2 s and reaches the boundary: the
    # search needs only the predicted size, one above, and the second step
    profile = run_timed(0.1, 0.04)
    timings = profile.timings
    assert timings is not None
    fake_steps = timings.fake_step_seconds
    assert fake_steps == pytest.approx((0.04,) * len(fake_steps))
    predicted = EXPECTED_FAKE_STEPS * FAKE_STEP_SECONDS_PER_TENSOR * 4
    assert predicted < 0.2 < sum(fake_steps) <= ESTIMATE_OVERRUN * 0.2
    assert timings.estimate_seconds == pytest.approx(sum(fake_steps))
    assert profile.method == "probe"
    assert not any("estimate stopped" in note for note in profile.notes)
    assert profile.num_trials == 4 and profile.num_ooms == 1
    assert profile.max_micro_batch_size == run(10.0).max_micro_batch_size


def test_a_started_estimate_stops_before_a_fake_step_past_its_overrun() -> None:
    # 10 s a real step: the estimate may save 20 s and overrun to 40 s. Fake steps of 15 s:
    # after the warm-up's 15 s and micro-batch 1's (30 s), one more would reach 45 s, so it
    # stops there and the search goes on from what it found, with real steps
    profile = run_timed(10.0, 15.0)
    timings = profile.timings
    assert timings is not None
    assert timings.fake_step_seconds == pytest.approx((15.0, 15.0))
    note = next(n for n in profile.notes if n.startswith("estimate stopped"))
    assert "after 2 fake steps (30 s), at 2x the 20 s of real steps" in note
    assert profile.max_micro_batch_size == run(10.0).max_micro_batch_size


def test_the_probe_s_clock_is_the_wall_clock_unless_one_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.undo()  # the suite's set clock (tests/conftest.py)
    step = StepSpec.build(mlp(), SAMPLE, loss_fn=F.cross_entropy)
    device = SimulatedDevice(capacity_bytes=4 * MIB)
    assert ProbeOptions.build(step, device=device).clock is time.perf_counter
    clock = SetClock()
    assert ProbeOptions.build(step, device=device, clock=clock).clock is clock


def test_an_estimate_out_of_budget_stops_after_its_warm_up_step() -> None:
    model = mlp()
    fake = FakeStep(
        model,
        torch.optim.AdamW(model.parameters()),
        BatchSource.from_sample(SAMPLE),
        loss_fn=F.cross_entropy,
    )
    points = estimate_points(fake, capacity_bytes=4 * MIB, search_limit=4096, budget_seconds=0)
    assert points == [] and fake.stopped_early and fake.num_steps == 1
    assert len(fake.step_seconds) == 1


def test_the_simulated_clock_counts_a_real_step_at_step_seconds() -> None:
    device = SimulatedDevice(capacity_bytes=MIB, step_seconds=5.0)
    started = device.clock()
    with device.measure([]):
        torch.ones(16).sum()
    assert 4.99 < device.clock() - started < 5.5
    assert device.with_gpu_fraction(0.5).step_seconds == 5.0
    assert device.deferring_oom().step_seconds == 5.0
    with pytest.raises(ConfigError, match="step_seconds -1"):
        SimulatedDevice(capacity_bytes=MIB, step_seconds=-1)


def test_timings_travel_with_the_profile_and_older_profiles_read_as_not_recorded() -> None:
    profile = run(10.0)
    data = profile.to_dict()
    assert Profile.from_dict(data) == profile
    assert profile.timings is not None
    assert list(data["timings"]["trial_seconds"]) == list(profile.timings.trial_seconds)
    assert Profile.from_dict(json.loads(json.dumps(data))) == profile
    del data["timings"]
    assert Profile.from_dict(data).timings is None


def test_timings_are_checked_and_described() -> None:
    timings = ProbeTimings(
        total_seconds=3.5,
        estimate_seconds=2.0,
        fake_step_seconds=(0.5, 1.5),
        trial_seconds=(0.5, 0.5, 0.25),
        cleanup_seconds=(0.0, 0.0, 0.125),
    )
    assert timings.real_seconds == 1.375
    assert timings.describe() == (
        "3.5 s: estimate 2 s (2 fake steps), 3 real trials 1.25 s, clean-up after 1 failure 0.125 s"
    )
    with pytest.raises(ConfigError, match="one per trial"):
        ProbeTimings(total_seconds=1.0, trial_seconds=(0.5,))
    with pytest.raises(ConfigError, match=">= 0"):
        ProbeTimings(total_seconds=-1.0)
