"""Plans past the largest measured micro-batch say ``predicted``, keep a growing margin, and refuse
lines that cannot be trusted; ``plan(..., source=...)`` and memory lines."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from autobatch.cli import main
from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import Plan
from autobatch.planning._prediction import (
    EXTRAPOLATION_GROWTH,
    Prediction,
    interpolated_peak_bytes,
    limit_within,
    measured_peaks,
    predict_past,
)
from autobatch.profile import MemoryModel, Profile, Trial
from autobatch.store._store import ProfileStore
from tests.planning.test_planner import plan, plan_world_sizes

GIB = 2**30
MIB = 2**20
UNIT = 8 * MIB  # the unit of memory of the step below


def issue_peak_bytes(micro_batch_size: int) -> int:
    """Issue 12's step: 0.2 + 0.06 b units up to b = 32, plus 0.0004 b**2 above (1 unit = 8 MiB)."""
    units = 0.2 + 0.06 * micro_batch_size
    if micro_batch_size > 32:
        units += 0.0004 * micro_batch_size**2
    return round(units * UNIT)


def issue_profile(**overrides: Any) -> Profile:
    """Probed on a 1.2-unit card: trials 1 and 16 fit, 17 runs out of memory."""
    capacity = round(1.2 * UNIT)
    fields: dict[str, Any] = {
        "max_micro_batch_size": 16,
        "recommended_micro_batch_size": 15,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (
            Trial(micro_batch_size=1, fits=True, peak_reserved_bytes=issue_peak_bytes(1)),
            Trial(micro_batch_size=16, fits=True, peak_reserved_bytes=issue_peak_bytes(16)),
            Trial(micro_batch_size=17, fits=False, oom=True),
        ),
        "num_steps": 4,
        "device_name": "sim",
        "device_type": "sim",
        "total_memory_bytes": capacity,
        "capacity_bytes": capacity,
        "memory_model": MemoryModel(
            fixed_bytes=round(0.2 * UNIT), bytes_per_sample=round(0.06 * UNIT)
        ),
    }
    fields.update(overrides)
    return Profile(**fields)


def true_max_micro_batch_size(capacity_bytes: int) -> int:
    return max(n for n in range(1, 1000) if issue_peak_bytes(n) <= capacity_bytes)


def test_issue_12_plan_for_a_larger_card_is_predicted_and_does_not_oom() -> None:
    capacity = 24 * UNIT
    assert true_max_micro_batch_size(capacity) == 180  # as the issue says

    result = plan(issue_profile(), effective_batch_size=1024, capacity_bytes=capacity)

    assert result.source == "predicted"
    assert result.max_micro_batch_size == 169
    assert issue_peak_bytes(result.max_micro_batch_size) <= capacity  # 276 would peak at 47
    assert result.prediction is not None
    assert result.prediction.largest_measured_micro_batch_size == 16
    assert result.prediction.num_fit_points == 2
    assert result.prediction.fit_residual_bytes == 0
    assert result.prediction.margin == pytest.approx(EXTRAPOLATION_GROWTH * (169 - 16) / 16)
    assert any("169 is predicted, not measured" in note for note in result.notes)
    # The same line without the margin (a caller's memory model) overshoots the true max.
    bare = plan(
        MemoryModel(fixed_bytes=issue_peak_bytes(0), bytes_per_sample=round(0.06 * UNIT)),
        effective_batch_size=1024,
        capacity_bytes=capacity,
    )
    assert bare.max_micro_batch_size > 180
    assert bare.source == "given"


def test_within_the_measured_sizes_a_plan_for_another_card_stays_measured() -> None:
    capacity = 1 * UNIT  # smaller than the probed card: 0.95 units usable
    result = plan(issue_profile(), effective_batch_size=24, capacity_bytes=capacity)

    # 0.2 + 0.06 * 12 = 0.92 <= 0.95 < 0.98 at 13, read off the line between measured 1 and 16.
    assert result.max_micro_batch_size == 12
    assert result.source == "measured"
    assert result.prediction is None
    assert result.micro_batch_sizes == (12, 12)
    assert result.predicted_peak_memory_bytes == interpolated_peak_bytes(
        {1: issue_peak_bytes(1), 16: issue_peak_bytes(16)}, 12
    )


@pytest.mark.parametrize(
    ("peaks", "pattern"),
    [
        ({8: 2 * GIB, 16: 2 * GIB}, "do not grow with the micro-batch"),
        ({8: 3 * GIB, 16: 2 * GIB}, r"slope -1\.342e\+08 bytes per sample"),
        # Convex: 1, 2, 5 GiB at 32, 48, 64 are 0.33 GiB off their line (7% of 5 GiB).
        ({32: 1 * GIB, 48: 2 * GIB, 64: 5 * GIB}, "are not on a line"),
    ],
)
def test_lines_that_cannot_be_trusted_are_not_extrapolated(
    peaks: dict[int, int], pattern: str
) -> None:
    trials = tuple(
        Trial(micro_batch_size=n, fits=True, peak_reserved_bytes=peak) for n, peak in peaks.items()
    )
    profile = issue_profile(
        trials=trials,
        max_micro_batch_size=max(peaks),
        recommended_micro_batch_size=max(peaks),
        total_memory_bytes=6 * GIB,
        capacity_bytes=6 * GIB,
    )
    with pytest.raises(ConfigError, match=pattern) as caught:
        plan(profile, effective_batch_size=64, capacity_bytes=80 * GIB)
    # The way forward in each surface's words: a call, a command and its flag, a route.
    from autobatch.cli._wording import cli_message
    from service.web.wording import describe

    python = str(caught.value)
    assert python.endswith("probe on that card instead (autobatch.autotune there, device='cuda:N')")
    assert cli_message(python, {}).endswith("(autobatch tune there, --device cuda:N)")
    assert describe(caught.value).endswith('(POST /v1/probes there, "device": "cuda:N")')


def test_a_convex_step_within_tolerance_is_fitted_and_reports_its_residual() -> None:
    peaks = {32: 1 * GIB, 48: 2 * GIB, 64: 3 * GIB + 100 * MIB}
    size, prediction = predict_past(peaks, budget_bytes=10 * GIB)

    assert prediction.num_fit_points == 3
    # Least squares: residuals +1/3, -2/3, +1/3 of 50 MiB.
    assert prediction.fit_residual_bytes == pytest.approx(100 * MIB / 3, abs=1)
    assert size > 64


def test_the_fit_uses_the_sizes_where_activations_dominate() -> None:
    # At micro-batch 1 the optimizer step dominates (3 GiB); 32..64 lie on 1 GiB + 40 MiB/sample.
    peaks = {1: 3 * GIB, 32: GIB + 32 * 40 * MIB, 48: GIB + 48 * 40 * MIB, 64: GIB + 64 * 40 * MIB}
    _, prediction = predict_past(peaks, budget_bytes=20 * GIB)

    assert prediction.num_fit_points == 3
    assert prediction.fixed_bytes == GIB
    assert prediction.bytes_per_sample == 40 * MIB
    assert prediction.fit_residual_bytes == 0


def test_the_margin_grows_with_the_distance_extrapolated() -> None:
    peaks = {8: GIB + 8 * 10 * MIB, 16: GIB + 16 * 10 * MIB}
    margins = []
    for budget in (2 * GIB, 4 * GIB, 8 * GIB, 16 * GIB):
        size, prediction = predict_past(peaks, budget_bytes=budget)
        line = GIB + size * 10 * MIB
        assert line * (1 + prediction.margin) <= budget
        margins.append(prediction.margin)
    assert margins == sorted(margins) and margins[0] > 0


def test_measured_peaks_skip_warm_up_and_failed_steps() -> None:
    trials = [
        Trial(micro_batch_size=4, fits=True, peak_allocated_bytes=100, warm_up=True),
        Trial(micro_batch_size=4, fits=True, peak_allocated_bytes=300),
        Trial(micro_batch_size=8, fits=True, peak_allocated_bytes=400, peak_reserved_bytes=500),
        Trial(micro_batch_size=16, fits=False, oom=True),
    ]
    assert measured_peaks(trials) == {4: 300, 8: 500}


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(99, 0), (100, 4), (149, 5), (150, 6), (200, 8), (10**9, 8)],
)
def test_limit_within_reads_the_measured_peaks(budget: int, expected: int) -> None:
    assert limit_within({4: 100, 6: 150, 8: 200}, budget) == expected


def test_below_the_smallest_measured_size_the_plan_is_predicted() -> None:
    profile = issue_profile(
        trials=(
            Trial(micro_batch_size=8, fits=True, peak_reserved_bytes=issue_peak_bytes(8)),
            Trial(micro_batch_size=16, fits=True, peak_reserved_bytes=issue_peak_bytes(16)),
        )
    )
    result = plan(profile, effective_batch_size=6, capacity_bytes=round(0.6 * UNIT))

    # 0.57 units usable: 0.2 + 0.06 * 6 = 0.56; measured sizes start at 8.
    assert result.max_micro_batch_size == 6
    assert result.source == "predicted"
    assert result.prediction is not None and result.prediction.margin == 0


def test_a_smaller_card_from_the_stored_line_alone_names_the_largest_size_that_ran(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # An older profile: no peaks kept, only the line; its largest fitting size was 16.
    profile = issue_profile(trials=(Trial(micro_batch_size=16, fits=True),))
    result = plan(profile, effective_batch_size=6, capacity_bytes=round(0.6 * UNIT))

    assert result.max_micro_batch_size == 6 and result.source == "predicted"
    assert result.prediction is not None
    assert result.prediction.largest_measured_micro_batch_size == 16  # not 1
    assert "the largest that really ran is 16" in result.notes[-1]
    store = tmp_path / "profiles.sqlite3"
    with ProfileStore(store) as opened:
        profile_id = opened.put(profile)
    argv = ["--store", str(store), "plan", "--profile", profile_id, "--effective-batch-size", "6"]
    assert main([*argv, "--world-size", "1,2", "--capacity", str(round(0.6 * UNIT))]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:3] == ["1", "6", "1"] and row.endswith("predicted: below measured 16")
    assert main([*argv, "--capacity", str(round(0.6 * UNIT))]) == 0
    out = capsys.readouterr().out
    assert "largest measured             16 (predicted below it: the profile's stored line" in out


# -- who says where the limit came from -----------------------------------------------------------


@pytest.mark.parametrize("source", ["measured", "cached"])
def test_the_caller_names_the_source_and_the_planner_only_adds_predicted(source: Any) -> None:
    within = plan(issue_profile(), effective_batch_size=30, source=source)
    past = plan(issue_profile(), effective_batch_size=30, capacity_bytes=24 * UNIT, source=source)

    assert within.source == source
    assert past.source == "predicted"


def test_an_estimate_stays_estimated_even_past_its_traced_sizes() -> None:
    profile = issue_profile(method="estimate")

    assert plan(profile, effective_batch_size=30).source == "estimated"
    past = plan(profile, effective_batch_size=30, capacity_bytes=24 * UNIT)
    assert past.source == "estimated"
    assert past.prediction is not None
    with pytest.raises(ConfigError, match="source 'cached' claims real trials"):
        plan(profile, effective_batch_size=30, source="cached")


@pytest.mark.parametrize("source", ["predicted", "guessed"])
def test_a_caller_cannot_claim_predicted_or_an_unknown_source(source: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"source {source!r} must be one of")):
        plan(issue_profile(), effective_batch_size=30, source=source)


def test_a_memory_model_plans_for_a_capacity_directly() -> None:
    model = MemoryModel(fixed_bytes=GIB, bytes_per_sample=100 * MIB)

    result = plan(model, effective_batch_size=64, capacity_bytes=8 * GIB)
    # int(8 GiB * 0.95) = 8160437862; (that - 1 GiB) // 100 MiB = 67.
    assert result.max_micro_batch_size == 67
    assert result.source == "given"
    assert result.predicted_peak_memory_bytes == model.peak_bytes(result.micro_batch_size)
    rows = plan_world_sizes(
        model, effective_batch_size=64, world_sizes=[1, 2], capacity_bytes=8 * GIB
    )
    assert [row.plan.micro_batch_size if row.plan else None for row in rows] == [64, 32]
    with pytest.raises(ConfigError, match="needs capacity_bytes"):
        plan(model, effective_batch_size=64)


def test_a_predicted_plan_round_trips_through_json_and_needs_its_prediction() -> None:
    result = plan(issue_profile(), effective_batch_size=1024, capacity_bytes=24 * UNIT)

    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    with pytest.raises(ConfigError, match="needs its prediction"):
        dataclasses.replace(result, prediction=None)
    with pytest.raises(ConfigError, match="not a valid prediction"):
        Plan.from_dict({**result.to_dict(), "prediction": {"margin": 0.5}})


def test_prediction_rejects_impossible_values() -> None:
    with pytest.raises(ConfigError, match="bytes_per_sample > 0"):
        Prediction(
            largest_measured_micro_batch_size=16,
            num_fit_points=2,
            fit_residual_bytes=0,
            fixed_bytes=0,
            bytes_per_sample=0,
            margin=0.0,
        )


GOOD_PREDICTION = {
    "largest_measured_micro_batch_size": 16,
    "num_fit_points": 2,
    "fit_residual_bytes": 0,
    "fixed_bytes": 10,
    "bytes_per_sample": 5,
    "margin": 0.5,
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("largest_measured_micro_batch_size", "16"),
        ("bytes_per_sample", None),
        ("bytes_per_sample", 2.5),
        ("num_fit_points", True),
        ("fixed_bytes", "10"),
        ("margin", "x"),
        ("margin", float("inf")),
    ],
)
def test_a_prediction_of_the_wrong_kind_is_refused_naming_the_field(field: str, value: Any) -> None:
    # What a service or a stored plan sends back: the error names the field and the value.
    data = {**GOOD_PREDICTION, field: value}
    with pytest.raises(
        ConfigError, match=rf"prediction's {field} must be .*, got {re.escape(repr(value))}"
    ):
        Prediction.from_dict(data)
    assert Prediction.from_dict(GOOD_PREDICTION).to_dict() == GOOD_PREDICTION


def test_the_cli_prints_a_predicted_plan_and_how_far_it_guessed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "profiles.sqlite3"
    with ProfileStore(store) as opened:
        profile_id = opened.put(issue_profile())
    argv = ["--store", str(store), "plan", "--profile", profile_id, "--effective-batch-size", "64"]

    assert main([*argv, "--capacity", str(24 * UNIT)]) == 0
    out = capsys.readouterr().out
    assert "source                       predicted" in out
    assert "largest measured             16 (predicted past it: 2 points" in out
    assert "note: max micro-batch 169 is predicted, not measured" in out
    assert main(argv) == 0  # on the card it was probed on: read from the store
    assert "source                       cached" in capsys.readouterr().out
    assert main([*argv, "--capacity", str(24 * UNIT), "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)["plan"]
    assert printed["prediction"]["largest_measured_micro_batch_size"] == 16


def test_a_new_margin_on_the_same_card_works_from_the_stored_line_alone() -> None:
    # An older profile: no peaks kept, only the line (0.2 units + 0.06 units per sample).
    profile = issue_profile(trials=(Trial(micro_batch_size=16, fits=True),))
    result = plan(profile, effective_batch_size=8, safety_margin=0.5)

    # int(1.2 units * 0.5) = 0.6 units: (0.6 - 0.2) / 0.06 = 6.67 -> 6.
    assert result.max_micro_batch_size == 6
    assert result.source == "measured"


def test_the_cli_world_size_table_marks_predicted_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "profiles.sqlite3"
    with ProfileStore(store) as opened:
        profile_id = opened.put(issue_profile())
    argv = ["--store", str(store), "plan", "--profile", profile_id, "--effective-batch-size", "64"]

    assert main([*argv, "--world-size", "1,2", "--capacity", str(24 * UNIT)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["1", "64", "1"], ["2", "32", "1"]]
    assert all(row.endswith("predicted: past measured 16") for row in rows)


def test_one_measured_size_without_a_stored_line_predicts_nothing() -> None:
    one = (Trial(micro_batch_size=16, fits=True, peak_reserved_bytes=issue_peak_bytes(16)),)
    profile = issue_profile(trials=one, memory_model=None)
    with pytest.raises(ConfigError, match="peaks measured at 1 micro-batch size.* probe on that"):
        plan(profile, effective_batch_size=8, capacity_bytes=24 * UNIT)


def test_a_smaller_card_never_gets_a_size_below_a_measured_peak_over_its_budget() -> None:
    # A new user's GPT-2 profile from a 3 GiB card: the warm-up step at 1 peaked at 2.30e9 bytes
    # (weights, gradients and the AdamW state it creates), above the stored line, which puts the
    # step at 2 at 1.99e9. Planned for a 2 GiB card, the line alone said micro-batch 2 fits; no
    # step at 2 can need less than the step at 1 did.
    warm_up_peak = 2_299_894_272
    profile = issue_profile(
        max_micro_batch_size=6,
        recommended_micro_batch_size=6,
        trials=(
            Trial(micro_batch_size=1, fits=True, warm_up=True, peak_reserved_bytes=warm_up_peak),
            Trial(micro_batch_size=6, fits=True, peak_reserved_bytes=2_985_000_000),
            Trial(micro_batch_size=7, fits=False, oom=True),
        ),
        total_memory_bytes=3 * GIB,
        capacity_bytes=3 * GIB,
        memory_model=MemoryModel(fixed_bytes=1_493_355_520, bytes_per_sample=248_271_360),
    )
    with pytest.raises(
        NoFeasiblePlanError, match=rf"needs .* \({warm_up_peak} bytes\) at micro-batch"
    ):
        plan(profile, effective_batch_size=96, capacity_bytes=2 * GIB)

    # With room for the warm-up's peak but not the line's step at 6, the size stays below 6 and
    # each predicted peak is at least the floor the warm-up measured.
    roomy = plan(profile, effective_batch_size=96, capacity_bytes=round(2.5 * GIB))
    assert roomy.source == "predicted"
    assert 1 <= roomy.max_micro_batch_size < 6
    assert roomy.predicted_peak_memory_bytes is not None
    assert roomy.predicted_peak_memory_bytes >= warm_up_peak
