"""The admission decision (service/admissions/decision.py), pure: the library's real plans over
GPU counts (plan_table within a max micro-batch of 36) in, a decision out."""

from __future__ import annotations

import dataclasses

import pytest

from autobatch.planning import PlanRequest, WorldSizeOption, plan_table
from service.admissions.decision import AdmissionPolicy, CardOptions, counts_to_plan, decide

H100, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L40S"


def options(
    effective_batch_size: int,
    counts: tuple[int, ...],
    *,
    card: str = H100,
    limit: int = 36,
    max_steps: int | None = None,
) -> CardOptions:
    request = PlanRequest(
        effective_batch_size=effective_batch_size,
        world_sizes=counts,
        max_gradient_accumulation_steps=max_steps,
    )
    rows = tuple(plan_table(limit, request))
    return CardOptions(card=card, profile_id=f"p-{card}", rows=rows)


def timed(card: CardOptions, seconds: dict[int, float]) -> CardOptions:
    """The same plans with step times (seconds per effective batch by GPU count)."""
    rows = tuple(
        dataclasses.replace(
            row,
            plan=dataclasses.replace(
                row.plan, predicted_seconds_per_effective_batch=seconds[row.world_size]
            ),
        )
        if row.plan is not None
        else row
        for row in card.rows
    )
    return dataclasses.replace(card, rows=rows)


def test_a_reachable_batch_is_accepted_with_its_plan() -> None:
    decision = decide([options(256, (1, 2, 4, 8))], world_size=8, policy=AdmissionPolicy())
    assert (decision.outcome, decision.card, decision.world_size) == ("accepted", H100, 8)
    assert decision.plan is not None
    # 256 over 8 GPUs: 32 each, within 36, in one step.
    assert (decision.plan.micro_batch_size, decision.plan.gradient_accumulation_steps) == (32, 1)
    assert decision.profile_id == f"p-{H100}"
    assert decision.reasons == (
        "accepted: effective batch 256 = micro-batch 32 x 1 accumulation step x 8 GPUs "
        f"(given) on {H100}",
    )


def test_an_unreachable_batch_names_the_nearest_and_the_counts_that_reach_it() -> None:
    # 97 is prime: no count but 1 divides it; at 8 GPUs the nearest are 96 and 104.
    card = options(97, (1, 2, 4, 8, 16))
    decision = decide([card], world_size=8, policy=AdmissionPolicy())
    assert decision.outcome == "unreachable"
    assert (decision.world_size, decision.plan, decision.card) == (None, None, None)
    assert decision.nearest_effective_batch_sizes == (96, 104)
    assert decision.reaching_world_sizes == (1,)
    assert decision.reasons[0].startswith(f"effective batch cannot be reached on 8 GPUs of {H100}")
    assert decision.reasons[1:] == (
        "nearest reachable effective batch sizes: 96, 104",
        "GPU counts that reach it: 1",
    )


def test_sizing_without_step_times_takes_the_fewest_gpus_that_reach_the_batch() -> None:
    # At most 2 accumulation steps of at most 36: 256 needs 64 per GPU or fewer, so 4 GPUs.
    card = options(256, (1, 2, 4, 8, 16), max_steps=2)
    decision = decide([card], world_size=16, policy=AdmissionPolicy(size=True))
    assert (decision.outcome, decision.world_size) == ("sized", 4)
    assert decision.plan is not None and decision.plan.world_size == 4
    assert (decision.plan.micro_batch_size, decision.plan.gradient_accumulation_steps) == (32, 2)
    assert decision.reaching_world_sizes == (4, 8, 16)
    assert "the fewest GPUs whose plan reaches it (of 4, 8, 16" in decision.reasons[0]


def test_sizing_with_step_times_holds_no_gpus_that_add_no_speed() -> None:
    card = timed(options(256, (1, 2, 4, 8, 16)), {1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0, 16: 0.98})
    decision = decide([card], world_size=None, policy=AdmissionPolicy(size=True))
    # 16 GPUs are 2% faster than 8: within 5%, so 8.
    assert (decision.outcome, decision.world_size) == ("sized", 8)
    assert (
        "within 5% of the fastest (1 s per effective batch against 0.98 s)" in (decision.reasons[0])
    )
    # Under a ceiling of 4 the fastest allowed is 4.
    capped = decide([card], world_size=None, policy=AdmissionPolicy(size=True, max_world_size=4))
    assert capped.world_size == 4
    # Allowed counts exclude 8: 16 is chosen (4 is twice as slow).
    only = AdmissionPolicy(size=True, allowed_world_sizes=(1, 2, 4, 16))
    assert decide([card], world_size=None, policy=only).world_size == 16


def test_the_first_card_that_reaches_the_batch_is_chosen() -> None:
    small = options(256, (8,), card=L40S, limit=4)  # 256/8 = 32 per GPU, 4 x 8 steps
    tight = dataclasses.replace(small, rows=tuple(options(256, (8,), limit=4, max_steps=4).rows))
    tight = dataclasses.replace(tight, card=L40S)
    big = options(256, (8,))
    decision = decide([tight, big], world_size=8, policy=AdmissionPolicy())
    assert (decision.outcome, decision.card) == ("accepted", H100)
    # Unreachable on both: the first card's nearest and reasons for each card.
    refused = decide([tight], world_size=8, policy=AdmissionPolicy())
    assert refused.outcome == "unreachable"
    assert refused.nearest_effective_batch_sizes == (128,)  # 4 x 4 x 8; none above
    assert small.rows[0].plan is not None and small.rows[0].plan.gradient_accumulation_steps == 8


def test_a_model_without_profiles_is_unplanned() -> None:
    missing = CardOptions(card=H100, profile_id=None, missing="no stored profile of fp")
    decision = decide([missing], world_size=8, policy=AdmissionPolicy())
    assert (decision.outcome, decision.world_size, decision.plan) == ("unplanned", None, None)
    assert decision.reasons == (f"{H100}: no stored profile of fp",)


def test_counts_and_bad_questions() -> None:
    assert counts_to_plan(12, AdmissionPolicy(max_world_size=16)) == (1, 2, 4, 8, 12, 16)
    with pytest.raises(ValueError, match="give world_size"):
        decide([options(8, (1,))], world_size=None, policy=AdmissionPolicy())
    with pytest.raises(ValueError, match="at least one candidate card"):
        decide([], world_size=1, policy=AdmissionPolicy())


def test_rows_are_the_library_rows() -> None:
    (row,) = options(97, (8,)).rows
    assert isinstance(row, WorldSizeOption) and row.plan is None


def test_nearest_batches_beyond_what_a_job_may_ask_are_not_named() -> None:
    # 97 at 8 GPUs: the nearest are 96 and 104; a bound of 100 leaves 96 alone, in the reasons too.
    card = options(97, (1, 8))
    bounded = AdmissionPolicy(largest_effective_batch_size=100)
    decision = decide([card], world_size=8, policy=bounded)
    assert decision.nearest_effective_batch_sizes == (96,)
    assert "nearest reachable effective batch sizes: 96" in decision.reasons
    unbounded = decide([card], world_size=8, policy=AdmissionPolicy())
    assert unbounded.nearest_effective_batch_sizes == (96, 104)
