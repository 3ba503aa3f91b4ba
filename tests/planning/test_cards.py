"""A plan predicted from other cards obeys the rule every measured plan obeys
(planning._cards, through select_profile): every node on a catalogued other card is one voice,
its max micro-batch predicted for the card asked about, and no single node, on whichever card,
moves the answer outside what the other nodes' predictions span."""

from __future__ import annotations

from typing import Any

import pytest

from autobatch.device import catalogue_memory_bytes
from autobatch.planning import select_profile
from autobatch.planning._cards import draw_predicted, predicted_max
from autobatch.profile import MemoryModel, Profile, StepIdentity, Trial

GIB, MIB = 2**30, 2**20
H100, L4, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L4", "NVIDIA L40S"
CARD_BYTES = {H100: 80 * GIB, L4: 24 * GIB}


def measured(card: str, node: str, *, fixed: int, per_sample: int) -> Profile:
    """A probe of ``node``'s ``card`` whose peaks lie on the line ``fixed + per_sample * n``,
    measured at half its maximum and at its maximum (5% margin)."""
    capacity = CARD_BYTES[card]
    maximum = (int(capacity * 0.95) - fixed) // per_sample
    sizes = (max(1, maximum // 2), maximum)
    fields: dict[str, Any] = {
        "max_micro_batch_size": maximum,
        "recommended_micro_batch_size": maximum,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": tuple(
            Trial(micro_batch_size=n, fits=True, peak_allocated_bytes=fixed + per_sample * n)
            for n in sizes
        ),
        "num_steps": 4,
        "device_name": card,
        "device_type": "cuda",
        "total_memory_bytes": capacity,
        "capacity_bytes": capacity,
        "node_name": node,
        "memory_model": MemoryModel(fixed_bytes=fixed, bytes_per_sample=per_sample),
        "created_at": "2026-12-01T00:00:00+00:00",
    }
    return Profile(**fields, identity=StepIdentity(model_fingerprint="fp"))


# Card A (an H100) with nodes a1, a2; card B (an L4) with nodes b1, b2: honest, a few percent
# apart, as two cards' runs of one model are.
HONEST = [
    ("a1", measured(H100, "a1", fixed=4 * GIB, per_sample=512 * MIB)),
    ("a2", measured(H100, "a2", fixed=4 * GIB, per_sample=530 * MIB)),
    ("b1", measured(L4, "b1", fixed=4 * GIB, per_sample=560 * MIB)),
    ("b2", measured(L4, "b2", fixed=4 * GIB, per_sample=600 * MIB)),
]
L40S_BYTES = catalogue_memory_bytes(L40S)


def _predictions(entries: list[tuple[str, Profile]]) -> list[int]:
    assert L40S_BYTES is not None
    found = [predicted_max(profile, L40S_BYTES) for _, profile in entries]
    assert None not in found
    return [size for size in found if size is not None]


@pytest.mark.parametrize("card", [H100, L4])
@pytest.mark.parametrize(
    ("fixed", "per_sample"),
    [(GIB, MIB), (4 * GIB, 4 * GIB), (4 * GIB, 550 * MIB)],
    ids=["high", "low", "between"],
)
def test_one_extra_node_on_either_card_leaves_the_prediction_where_the_four_put_it(
    card: str, fixed: int, per_sample: int
) -> None:
    extra = ("x", measured(card, "node-x", fixed=fixed, per_sample=per_sample))
    honest = _predictions(HONEST)

    for entries in ([*HONEST, extra], [extra, *HONEST[::-1]]):
        chosen = select_profile(entries, card=L40S, node=None, conditions={})
        assert chosen is not None and chosen.match == "predicted"
        assert L40S_BYTES is not None
        answer = predicted_max(chosen.profile, L40S_BYTES)
        assert answer is not None and min(honest) <= answer <= max(honest)
        assert chosen.profile_id != "x" or per_sample == 550 * MIB  # only an honest value
        assert len(chosen.considered) == 5 and chosen.rests_on is None
        assert "predicted for 48.0 GiB" in chosen.basis


def test_which_card_a_node_measured_on_gives_it_no_weight() -> None:
    # Before, the card measured by the most nodes spoke: a third node on card B made B's
    # more conservative node answer, on card A the A's. Now the answer is the second most
    # conservative of the five predictions, wherever the fifth node sits.
    answers = set()
    for card in (H100, L4):
        extra = ("x", measured(card, "node-x", fixed=4 * GIB, per_sample=8 * GIB))  # low
        chosen = select_profile([*HONEST, extra], card=L40S, node=None, conditions={})
        assert chosen is not None
        answers.add(chosen.profile_id)
        assert chosen.outliers == ("node-x",)
    assert answers == {"b2"}  # the most conservative honest voice, whichever card x joined


def test_with_fewer_than_three_voices_the_answer_rests_on_a_node() -> None:
    drawn, spread = draw_predicted(
        [(pid, profile, []) for pid, profile in HONEST[1:3]], target_bytes=L40S_BYTES
    )
    assert (drawn.chosen[0], drawn.rests_on) == ("b1", "b1")  # the lower prediction of two
    assert spread.startswith("each node's max micro-batch predicted for 48.0 GiB: ")
    # Without the card's memory, the voices are drawn by their own measured maxima.
    unknown, said = draw_predicted(
        [(pid, profile, []) for pid, profile in HONEST], target_bytes=None
    )
    assert said == "" and unknown.chosen[0] == "b1"
