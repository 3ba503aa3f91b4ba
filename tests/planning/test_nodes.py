"""Each node counts once and no node alone decides (planning._nodes, through select_profile):
a flood, a lone outlier high or low, a capped search and a fictitious card each leave the answer
where the honest nodes put it, and the answer names the outliers or the node it rests on."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from autobatch.planning import select_profile
from autobatch.planning._nodes import draw_among_nodes, is_lower_bound
from autobatch.profile import MemoryModel, Profile, StepIdentity, Trial

GIB = 2**30
H100, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L40S"


def profile(node: str, maximum: int, **changes: Any) -> Profile:
    fields: dict[str, Any] = {
        "max_micro_batch_size": maximum,
        "recommended_micro_batch_size": maximum,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (Trial(micro_batch_size=maximum, fits=True, peak_reserved_bytes=20 * GIB),),
        "num_steps": 2,
        "device_name": H100,
        "device_type": "cuda",
        "total_memory_bytes": 80 * GIB,
        "capacity_bytes": 79 * GIB,
        "node_name": node,
        "created_at": "2026-12-01T00:00:00+00:00",
    }
    fields.update(changes)
    return Profile(**fields, identity=StepIdentity(model_fingerprint="fp"))


HONEST = [("b-64", profile("node-b", 64)), ("c-60", profile("node-c", 60))]


def by_card(candidates: list[tuple[str, Profile]], card: str = H100) -> Any:
    chosen = select_profile(candidates, card=card, node=None, conditions={})
    reverse = select_profile(candidates[::-1], card=card, node=None, conditions={})
    assert chosen is not None and reverse == chosen  # the order of publishing changes nothing
    return chosen


def test_a_flood_of_one_node_counts_once_and_moves_nothing() -> None:
    flood = [
        (f"a-{i:02d}", profile("node-a", 4096, created_at=f"2026-12-02T00:00:{i:02d}+00:00"))
        for i in range(61)
    ]

    chosen = by_card([*flood, *HONEST])

    assert (chosen.profile_id, chosen.profile.max_micro_batch_size) == ("b-64", 64)
    assert chosen.considered == ("a-60", "b-64", "c-60")  # node-a's latest, once
    assert chosen.max_micro_batch_size_range == (60, 4096)
    assert (chosen.outliers, chosen.rests_on) == (("node-a",), None)
    assert "outliers, outside what every other node measured: node-a" in chosen.basis
    # Asked for node-b, the answer is node-b's own profile, whatever node-a published.
    mine = select_profile([*flood, *HONEST], card=None, node="node-b", conditions={})
    assert mine is not None and (mine.profile_id, mine.rests_on) == ("b-64", "node-b")


@pytest.mark.parametrize("rogue", [1, 2, 61, 63, 65, 10**6])
@pytest.mark.parametrize("num_profiles", [1, 7])
@pytest.mark.parametrize("honest", [(64, 64), (60, 64), (32, 48, 64)])
def test_one_node_never_moves_the_answer_outside_what_the_others_measured(
    rogue: int, num_profiles: int, honest: tuple[int, ...]
) -> None:
    others = [(f"h{i}", profile(f"honest-{i}", value)) for i, value in enumerate(honest)]
    lies = [
        (f"r{i}", profile("rogue", rogue + i, created_at=f"2026-12-0{1 + i % 9}T00:00:00+00:00"))
        for i in range(num_profiles)
    ]

    chosen = by_card([*lies, *others])

    value = chosen.profile.max_micro_batch_size
    assert min(honest) <= value <= max(honest), (rogue, honest, value)
    far = rogue + num_profiles - 1
    if far > 1.25 * max(honest) or 1.25 * rogue < min(honest):
        assert "rogue" in chosen.outliers


def test_a_lone_low_node_does_not_drag_every_plan_down() -> None:
    chosen = by_card([("a-1", profile("node-a", 1)), *HONEST])

    assert chosen.profile.max_micro_batch_size == 60
    assert chosen.outliers == ("node-a",)


def test_with_fewer_than_three_nodes_the_answer_names_the_node_it_rests_on() -> None:
    two = by_card(HONEST)
    assert (two.profile_id, two.rests_on, two.outliers) == ("c-60", "node-c", ())
    one = by_card(HONEST[:1])
    assert (one.profile_id, one.rests_on) == ("b-64", "node-b")
    assert one.basis.startswith("rests on node node-b alone: the only node that measured it")


def capped(node: str, maximum: int) -> Profile:
    return profile(node, maximum, stop_kind="limit", stop_reason=f"limit {maximum} reached")


def test_a_capped_search_is_a_lower_bound_never_a_maximum() -> None:
    measured = ("m-20873", profile("node-m", 20873))
    bounds = [("cap-a", capped("node-a", 4096)), ("cap-b", capped("node-b", 4096))]

    chosen = by_card([measured, *bounds])

    assert (chosen.profile_id, chosen.rests_on) == ("m-20873", "node-m")
    assert chosen.considered == ("m-20873",)  # a lower bound never agrees with a maximum
    assert chosen.lower_bounds == ("node-a", "node-b")
    assert "set aside as lower bounds" in chosen.basis
    # Only lower bounds: drawn among them, and the answer says it is one.
    only = by_card(bounds)
    assert only.profile.max_micro_batch_size == 4096
    assert "each a lower bound" in only.basis and only.lower_bounds == ()
    confirmed = profile("node-c", 50, stop_reason="confirmation: predicted 50 from A100")
    assert is_lower_bound(confirmed) and not is_lower_bound(profile("node-c", 50))


def test_a_card_nobody_can_check_never_speaks_for_a_real_card() -> None:
    fictitious = profile(
        "node-a",
        500_000,
        device_name="NVIDIA B999",
        total_memory_bytes=2**50,
        capacity_bytes=2**50,
        memory_model=MemoryModel(fixed_bytes=0, bytes_per_sample=1),
    )
    honest = profile("node-b", 32, memory_model=MemoryModel(fixed_bytes=GIB, bytes_per_sample=GIB))

    chosen = by_card([("b999", fictitious), ("h100", honest)], card=L40S)

    assert (chosen.profile_id, chosen.match) == ("h100", "predicted")
    assert select_profile([("b999", fictitious)], card=L40S, node=None, conditions={}) is None
    # Asked for itself, a card's own profile still answers (measured there, for that card).
    assert by_card([("b999", fictitious)], card="NVIDIA B999").profile_id == "b999"


def test_profiles_without_a_node_share_one_voice_and_the_latest_speaks() -> None:
    entries = [
        (f"anon-{i}", profile("", value, created_at=f"2026-12-0{i + 1}T00:00:00+00:00"), [])
        for i, value in enumerate((8, 16, 24))
    ]
    drawn = draw_among_nodes(list(itertools.chain(entries[::-1])))
    assert (drawn.chosen[0], drawn.rests_on, len(drawn.voices)) == ("anon-2", "", 1)
    with pytest.raises(ValueError, match="at least one profile"):
        draw_among_nodes([])


@pytest.mark.parametrize("low", [1, 40])
def test_a_lone_low_node_does_not_undercut_two_nodes_that_showed_more_fitting(low: int) -> None:
    bounds = [("cap-b", capped("node-b", 64)), ("cap-c", capped("node-c", 64))]

    chosen = by_card([("z-low", profile("node-z", low)), *bounds])

    assert chosen.profile.max_micro_batch_size == 64 and chosen.profile_id == "cap-b"
    assert chosen.outliers == ("node-z",) and "each a lower bound" in chosen.basis
    # A measured maximum and a lower bound contradict it alike; one of them alone does not.
    mixed = by_card([("z-low", profile("node-z", low)), ("b-64", profile("node-b", 64)), bounds[1]])
    assert (mixed.profile_id, mixed.outliers) == ("b-64", ("node-z",))
    alone = by_card([("z-low", profile("node-z", low)), bounds[0]])
    assert (alone.profile_id, alone.outliers, alone.rests_on) == ("z-low", (), "node-z")
    # Within OUTLIER_FACTOR of what the others ran, a lower maximum is honest and answers.
    near = by_card([("z-60", profile("node-z", 60)), *bounds])
    assert near.profile_id == "z-60"


def test_a_lone_node_on_a_bigger_card_does_not_outrank_two_nodes_that_agree() -> None:
    # These profiles predict nothing for an L40S (one peak each, no line): the voices are drawn
    # by their own maxima, every node once, whatever its card (planning._cards).
    h200 = {"device_name": "NVIDIA H200", "total_memory_bytes": 140 * GIB}
    lone = ("z-h200", profile("node-z", 4096, **h200, capacity_bytes=139 * GIB))

    chosen = by_card([lone, *HONEST], card=L40S)

    assert (chosen.profile_id, chosen.match) == ("b-64", "predicted")  # the second of three
    assert (chosen.outliers, chosen.rests_on) == (("node-z",), None)
    # Two nodes on each card: the second of four, within what the H100's two measured ...
    second = ("y-h200", profile("node-y", 2048, **h200, capacity_bytes=139 * GIB))
    both = by_card([lone, second, *HONEST], card=L40S)
    assert (both.profile_id, both.rests_on) == ("b-64", None)
    # ... and one node alone on each card: the more conservative of two, resting on it.
    alone = by_card([lone, HONEST[0]], card=L40S)
    assert (alone.profile_id, alone.rests_on) == ("b-64", "node-b")
