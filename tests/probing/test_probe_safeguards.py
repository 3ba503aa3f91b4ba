"""The probe on cards where the peaks do not predict the failures: thresholds, launch
limits, the allocator's own assertion, an estimate off by 5x, sizes no plan can use."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autobatch import autotune, probe
from autobatch.cli import main
from autobatch.device._simulated import SimulatedDevice
from autobatch.probing._search import trial_budget
from autobatch.probing._trials import UNRELIABLE_ESTIMATE
from autobatch.profile import Profile
from tests.helpers.probe_stubs import ALLOCATOR_ASSERT, LAUNCH_LIMIT, FailsAbove
from tests.planning.test_planner import plan

SAMPLE = torch.randn(2, 64)


def search_trials(profile: Profile) -> int:
    """Trials counted against the budget: not the warm-up, nor the chosen size's second step."""
    return sum(1 for t in profile.trials if not t.warm_up and not t.repeat)


@pytest.mark.slow  # ~10 s: 14 real steps (tests/probing/test_search.py has the fast version)
def test_a_threshold_the_peaks_do_not_show_is_found_from_what_ran() -> None:
    # once: 20000, 19999, 19998, 19997, 9999, 9998, ... 37 (31 trials, 28 OOMs); then bisection
    # from the failed limit: 20000, 10000, 5000, ... (15 search trials, 11 OOMs); now the
    # search from what ran: 12 trials and 4 OOMs, as many OOMs as doubling-then-bisect
    profile = probe(  # dear steps (1 s each on the card's clock): the estimate runs first
        FailsAbove(37),
        SAMPLE,
        device=SimulatedDevice(capacity_bytes=1 << 30),
        max_micro_batch_size=20_000,
    )
    assert profile.max_micro_batch_size == 37
    assert search_trials(profile) <= 12 < trial_budget(20_000) == math.ceil(math.log2(20_000)) + 3
    assert profile.num_ooms <= 4
    sizes = [t.micro_batch_size for t in profile.trials]
    # the estimate's size, then the search from what ran: 1 fitted, 20000 failed
    assert sizes[:3] == [1, 20_000, 138]


def test_the_allocator_s_nvml_assertion_is_an_oom() -> None:
    model = FailsAbove(32, lambda: RuntimeError(ALLOCATOR_ASSERT))
    profile = probe(model, SAMPLE, device="sim:1GiB", max_micro_batch_size=64)
    assert profile.max_micro_batch_size == 32  # once: 1
    assert profile.num_ooms >= 1 and not profile.failed_micro_batch_size


def test_a_launch_limit_is_an_upper_bound_named_in_profile_plan_and_notes() -> None:
    model = FailsAbove(300, lambda: RuntimeError(LAUNCH_LIMIT))
    profile = probe(model, SAMPLE, device="sim:1GiB", max_micro_batch_size=512)
    assert profile.max_micro_batch_size == 300
    assert profile.failed_micro_batch_size == 301
    failed = next(t for t in profile.trials if t.micro_batch_size == 301)
    assert LAUNCH_LIMIT in failed.error and not failed.oom and not failed.fits
    assert search_trials(profile) <= trial_budget(512)
    assert LAUNCH_LIMIT in profile.failure_note and "largest micro-batch that ran is 300" in (
        profile.failure_note
    )
    assert profile.failure_note in profile.notes
    result = plan(profile, effective_batch_size=600)
    assert result.micro_batch_size <= 300
    assert profile.failure_note in result.notes
    again = Profile.from_dict(profile.to_dict())
    assert again.failure_note == profile.failure_note


def test_autotune_never_tries_a_size_no_plan_can_use() -> None:
    # the case: a launch limit at 65536; E=1000 once tried 65536 and answered 1 x 1000
    seen: list[int] = []

    def step(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.shape[0])  # fake (the estimate's search) and real
        loss: torch.Tensor = model(batch)
        return loss

    model = FailsAbove(65_535, lambda: RuntimeError(LAUNCH_LIMIT))
    result = autotune(
        model,
        SAMPLE,
        train_step=step,
        effective_batch_size=1000,
        device="sim:8GiB",
        use_store=False,
    )
    assert max(seen) <= 1000
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == (1000, 1)
    seen.clear()
    autotune(
        model,
        SAMPLE,
        train_step=step,
        effective_batch_size=1000,
        world_size=8,
        device="sim:8GiB",
        use_store=False,
    )
    assert max(seen) <= 125


@pytest.mark.parametrize(("extra_activation", "sign"), [(5, -1), (-5, 1)])
def test_an_estimate_off_by_5x_is_called_unreliable_and_the_search_still_exact(
    extra_activation: int, sign: int
) -> None:
    capacity = 8 * 2**20
    model = FailsAbove(None, extra_activation=extra_activation)
    profile = probe(model, SAMPLE, device=SimulatedDevice(capacity_bytes=capacity))
    assert search_trials(profile) <= trial_budget(1 << 16)
    compared = [t for t in profile.trials if t.estimate_error is not None]
    error = compared[0].estimate_error
    assert error is not None and abs(error) > UNRELIABLE_ESTIMATE
    assert math.copysign(1, error) == sign
    assert any("estimate was unreliable" in note for note in profile.notes)
    assert profile.method == "probe"  # an estimate started the search
    # exact: the max fits, one more does not (the real step, measured on the same device)
    assert exact_max(model, capacity) == profile.max_micro_batch_size


def exact_max(model: torch.nn.Module, capacity: int) -> int:
    """Largest n whose real step fits (checked at the answer's neighbours only)."""
    from autobatch.probing._batch import BatchSource
    from autobatch.probing._step import TrainingStep

    model.train()
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()))
    source = BatchSource.from_sample(SAMPLE)
    step.run(source.make(1))
    device = SimulatedDevice(capacity_bytes=capacity)
    state = step.optimizer.state

    def fits(n: int) -> bool:
        resident = [*model.parameters(), *[v for s in state.values() for v in s.values()]]
        try:
            with device.measure(resident):
                step.run(source.make(n))
        except torch.OutOfMemoryError:
            return False
        return True

    n = 1
    while fits(n * 2):
        n *= 2
    lo, hi = n, n * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def test_a_good_estimate_stands_beside_each_measured_peak_in_three_trials() -> None:
    # A card whose real steps are dear (1 s each on its clock): the estimate pays for itself.
    profile = probe(FailsAbove(None), SAMPLE, device=SimulatedDevice(capacity_bytes=8 * 2**20))
    # warm-up, the estimate's size, one above (and the chosen size's second step)
    assert [t.micro_batch_size for t in profile.trials if not t.repeat] == [1, 5426, 5427]
    assert profile.num_ooms == 1
    measured = [t for t in profile.trials if t.fits and not t.warm_up]
    assert measured and all(t.estimated_peak_bytes > 0 for t in measured)
    errors = [t.estimate_error for t in measured]
    assert all(e is not None and abs(e) <= 0.01 for e in errors)
    assert any(note.startswith("estimated vs measured peak") for note in profile.notes)
    assert not any("unreliable" in note for note in profile.notes)


def test_the_cli_says_so_in_plain_words(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        [
            "--store",
            str(tmp_path / "s.sqlite3"),
            "tune",
            "tests.helpers.probe_stubs:launch_limited",
            "--input-shape",
            "16",
            "--device",
            "sim:64MiB",
            "--effective-batch-size",
            "1200",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "micro_batch_size             300" in out
    assert "note: micro-batch 301 failed for a reason other than memory" in out
    assert LAUNCH_LIMIT in out
