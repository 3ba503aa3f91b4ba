"""Which stored profile answers a plan for a card type or a node (planning.selection)."""

from __future__ import annotations

from typing import Any

import pytest

from autobatch.conditions import Conditions
from autobatch.device import BudgetReading, BudgetSource, MemoryBudget, combine_budget
from autobatch.errors import ConfigError
from autobatch.planning import condition_mismatches, select_profile
from autobatch.planning._selection import measured_share
from autobatch.profile import Profile, StepIdentity, Trial

GIB = 2**30
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
BF16 = Conditions(device_type="cuda", amp_dtype="bfloat16", optimizer="torch.optim.adamw.AdamW")
FP16 = Conditions(device_type="cuda", amp_dtype="float16", optimizer="torch.optim.adamw.AdamW")


def profile(card: str, node: str, conditions: Conditions = BF16, **changes: Any) -> Profile:
    fields: dict[str, Any] = {
        "max_micro_batch_size": 32,
        "recommended_micro_batch_size": 30,
        "safety_margin": 0.05,
        "method": "probe",
        "trials": (Trial(micro_batch_size=32, fits=True, peak_reserved_bytes=20 * GIB),),
        "num_steps": 2,
        "device_name": card,
        "device_type": "cuda",
        "total_memory_bytes": 80 * GIB,
        "capacity_bytes": 80 * GIB,
        "node_name": node,
        "conditions": conditions,
    }
    fields.update(changes)
    return Profile(**fields, identity=StepIdentity(model_fingerprint="fp"))


# Newest first, as the store lists them (the choice does not depend on the order).
STORE = [
    ("a100-n3-fp16", profile(A100, "n3", FP16)),
    (
        "h100-n2-fp16",
        profile(H100, "n2", FP16, max_micro_batch_size=28, recommended_micro_batch_size=26),
    ),
    ("h100-n1-bf16", profile(H100, "n1", BF16)),
    ("a100-n4-bf16", profile(A100, "n4", BF16)),
    (
        "h100-n0-bf16-old",
        profile(H100, "n0", BF16, max_micro_batch_size=40, recommended_micro_batch_size=36),
    ),
]


@pytest.mark.parametrize(
    ("card", "node", "conditions", "profile_id", "match"),
    [
        # The most conservative profile of the card under the conditions asked, on any node.
        (H100, None, {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "measured"),
        (H100, None, {"amp_dtype": "float16"}, "h100-n2-fp16", "measured"),
        # No conditions asked: three nodes measured the card, so the second most conservative
        # answers (no one node decides).
        (H100, None, {}, "h100-n1-bf16", "measured"),
        # The card in its node-label and catalogue forms is the same card.
        ("NVIDIA-H100-80GB-HBM3", None, {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "measured"),
        ("H100 80GB HBM3", None, {"amp_dtype": "float16"}, "h100-n2-fp16", "measured"),
        # The node's own profile first, even when the card has a newer one elsewhere.
        (H100, "n0", {"amp_dtype": "bfloat16"}, "h100-n0-bf16-old", "measured"),
        # The node has none under these conditions: the card's, on another node, is measured.
        (H100, "n2", {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "measured"),
        # A node alone: its card is the one its profiles were measured on.
        (None, "n4", {}, "a100-n4-bf16", "measured"),
        (None, "n3", {"amp_dtype": "bfloat16"}, "a100-n4-bf16", "measured"),
        # The card only under other conditions: predicted from the card's profile.
        (A100, None, {"amp_dtype": "bfloat16", "optimizer": "x.SGD"}, "a100-n3-fp16", "predicted"),
        # A card with no profile: every node on another catalogued card is a voice, under the
        # conditions asked, drawn by its max predicted for the L4's 24 GiB (planning._cards).
        # Of n0, n1 and n4 (bf16) none predicts (one peak, no line): drawn by their maxima, the
        # second of three. Of all five, only n2's profile predicts (28: its peak at 32 fits),
        # so the answer rests on n2 alone.
        ("NVIDIA L4", None, {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "predicted"),
        ("NVIDIA L4", None, {}, "h100-n2-fp16", "predicted"),
        # An unknown node with no card: drawn among the model's five nodes (the second most
        # conservative), predicted, and it says the node's card is unknown.
        (None, "n9", {}, "a100-n3-fp16", "predicted"),
    ],
)
def test_select_profile_ranks_card_node_and_conditions(
    card: str | None, node: str | None, conditions: dict[str, Any], profile_id: str, match: str
) -> None:
    chosen = select_profile(STORE, card=card, node=node, conditions=conditions)
    reverse = select_profile(STORE[::-1], card=card, node=node, conditions=conditions)

    assert chosen is not None
    assert (chosen.profile_id, chosen.match) == (profile_id, match)
    assert bool(chosen.reasons) == (match == "predicted")
    assert reverse == chosen


def test_predicted_selection_names_where_it_was_measured_and_what_differs() -> None:
    chosen = select_profile(STORE, card="NVIDIA L4", node=None, conditions={"amp_dtype": "float16"})

    assert chosen is not None
    assert (chosen.profile_id, chosen.rests_on) == ("h100-n2-fp16", "n2")  # it alone predicts
    assert chosen.reasons == (f"measured on {H100} (node n2), not NVIDIA L4",)
    assert not chosen.same_card
    other = select_profile(STORE, card=A100, node=None, conditions={"optimizer": "x.SGD"})
    assert other is not None and other.same_card
    assert other.reasons == (
        "measured under other conditions: optimizer: recorded "
        "'torch.optim.adamw.AdamW', asked 'x.SGD'",
    )
    unknown_node = select_profile(STORE, card=None, node="n9", conditions={})
    assert unknown_node is not None
    assert "node n9 has no profile of this model" in unknown_node.reasons[0]


def test_estimates_answer_estimated_and_eval_profiles_never_answer() -> None:
    estimate = profile(H100, "n1", method="estimate")
    evaluation = profile(H100, "n1", mode="eval")

    chosen = select_profile(
        [("eval", evaluation), ("est", estimate)], card=H100, node=None, conditions={}
    )
    assert chosen is not None
    assert (chosen.profile_id, chosen.match) == ("est", "estimated")
    assert select_profile([("eval", evaluation)], card=H100, node=None, conditions={}) is None
    assert select_profile([], card=H100, node=None, conditions={}) is None


@pytest.mark.parametrize(
    ("recorded", "wanted", "expected"),
    [
        (BF16, {"amp_dtype": "bfloat16"}, []),
        (BF16, {"amp_dtype": "float16"}, ["amp_dtype: recorded 'bfloat16', asked 'float16'"]),
        (Conditions(), {"amp_dtype": "bfloat16"}, ["amp_dtype: not recorded, asked 'bfloat16'"]),
        (BF16, {"allocator_settings": ""}, ["allocator_settings: not recorded, asked ''"]),
        (
            Conditions(device_type="cuda", parameter_bytes={"float32": 8}),
            {"parameter_bytes": {"float32": 8}},
            [],
        ),
        (BF16, {"num_parameters": 10}, ["num_parameters: not recorded, asked 10"]),
    ],
)
def test_condition_mismatches(
    recorded: Conditions, wanted: dict[str, Any], expected: list[str]
) -> None:
    assert condition_mismatches(recorded, wanted) == expected


def test_unknown_condition_names_are_refused_with_the_known_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown condition\(s\) 'amp':.*amp_dtype"):
        select_profile(STORE, card=H100, node=None, conditions={"amp": "bf16"})
    with pytest.raises(ConfigError, match="unknown condition"):
        select_profile([], card=H100, node=None, conditions={"amp": "bf16"})


def budget(*limits: tuple[BudgetSource, int]) -> MemoryBudget:
    """A probe's budget on an 80 GiB card, with ``limits`` (source, bytes) below it."""
    card = BudgetReading(
        source="nvml", total_bytes=80 * GIB, available_bytes=79 * GIB, free_bytes=79 * GIB
    )
    readings = [
        card,
        *(BudgetReading(source=s, total_bytes=b, available_bytes=b) for s, b in limits),
    ]
    return combine_budget(readings)


WHOLE = profile(H100, "node-whole", budget=budget(), capacity_bytes=79 * GIB)
SHARE = profile(
    H100,
    "node-shared",
    max_micro_batch_size=8,
    recommended_micro_batch_size=8,
    trials=(Trial(micro_batch_size=8, fits=True, peak_reserved_bytes=20 * GIB),),
    budget=budget(("time_slicing", 22 * GIB)),
    capacity_bytes=22 * GIB,
)


@pytest.mark.parametrize("order", [1, -1], ids=["share-last", "whole-last"])
def test_a_share_never_speaks_for_the_whole_card_whichever_was_published_last(order: int) -> None:
    published = [("whole", WHOLE), ("share", SHARE)][::order]

    by_card = select_profile(published, card="NVIDIA-H100-80GB-HBM3", node=None, conditions={})
    by_node = select_profile(published, card=None, node="node-shared", conditions={})
    other_node = select_profile(published, card=None, node="node-whole", conditions={})

    assert by_card is not None and by_node is not None and other_node is not None
    assert (by_card.profile_id, by_card.match, by_card.considered) == (
        "whole",
        "measured",
        ("whole",),
    )
    assert by_card.budget_bytes is None
    # The shared node: its own share's profile, measured; the whole card's node: its own.
    assert (by_node.profile_id, by_node.match, by_node.reasons) == ("share", "measured", ())
    assert (other_node.profile_id, other_node.match) == ("whole", "measured")


def test_a_share_asked_is_answered_by_an_agreeing_share_or_the_whole_card_scaled() -> None:
    both = [("whole", WHOLE), ("share", SHARE)]
    # A 22.5 GiB share agrees with the 22 GiB one (within 5%): measured from it.
    agreeing = select_profile(both, card=H100, node=None, conditions={}, budget_bytes=45 * GIB // 2)
    assert agreeing is not None
    assert (agreeing.profile_id, agreeing.match, agreeing.budget_bytes) == (
        "share",
        "measured",
        None,
    )
    # A 40 GiB share: no share of that size was measured; the whole card's profile, planned for
    # the share's budget, predicted.
    half = select_profile(both, card=H100, node=None, conditions={}, budget_bytes=40 * GIB)
    assert half is not None
    assert (half.profile_id, half.match, half.budget_bytes) == ("whole", "predicted", 40 * GIB)
    assert half.reasons == (
        "measured on the whole card (79.00 GiB), planned for a share of 40.00 GiB",
    )
    # The whole card's memory asked: the whole card's profile, measured.
    whole = select_profile(both, card=H100, node=None, conditions={}, budget_bytes=80 * GIB)
    assert whole is not None and (whole.profile_id, whole.match) == ("whole", "measured")


def test_only_shares_measured_leaves_a_whole_card_unanswered() -> None:
    assert select_profile([("share", SHARE)], card=H100, node=None, conditions={}) is None
    # ... and another card's share predicts nothing either.
    assert select_profile([("share", SHARE)], card=A100, node=None, conditions={}) is None
    shared = select_profile(
        [("share", SHARE)], card=H100, node=None, conditions={}, budget_bytes=22 * GIB
    )
    assert shared is not None and shared.match == "measured"


@pytest.mark.parametrize(
    ("limits", "share"),
    [
        ((), False),
        ((("gpu_fraction", 40 * GIB),), True),  # fractional
        ((("vgpu_limit", 20 * GIB),), True),  # virtualised
        ((("time_slicing", 22 * GIB),), True),  # time_sliced
        ((("vgpu_limit", 78 * GIB),), False),  # within 5% of the card
    ],
)
def test_measured_share_reads_the_profiles_budget(
    limits: tuple[tuple[BudgetSource, int], ...], share: bool
) -> None:
    assert measured_share(profile(H100, "n", budget=budget(*limits))) is share
    assert not measured_share(profile(H100, "n", capacity_bytes=40 * GIB))  # no budget: as ever


@pytest.mark.parametrize("order", [1, -1])
def test_three_agreeing_nodes_answer_the_second_most_conservative_with_the_spread(
    order: int,
) -> None:
    published = [
        ("p-40", profile(H100, "n1", max_micro_batch_size=40, recommended_micro_batch_size=36)),
        ("p-32", profile(H100, "n2")),
        ("p-36", profile(H100, "n3", max_micro_batch_size=36, recommended_micro_batch_size=34)),
        ("p-a100", profile(A100, "n4", max_micro_batch_size=8, recommended_micro_batch_size=8)),
    ][::order]

    chosen = select_profile(published, card=H100, node=None, conditions={"amp_dtype": "bfloat16"})

    assert chosen is not None
    assert (chosen.profile_id, chosen.match) == ("p-36", "measured")
    assert chosen.considered == ("p-32", "p-36", "p-40")
    assert chosen.max_micro_batch_size_range == (32, 40)
    assert (chosen.outliers, chosen.rests_on, chosen.lower_bounds) == ((), None, ())
    assert chosen.basis == (
        "drawn among 3 nodes, one profile each: the second most conservative (smallest "
        "recommended, then max micro-batch), so no one node moves it outside what the others "
        "measured (max micro-batch 32..40)"
    )
    # Two nodes: the more conservative, and the answer says whose word it rests on.
    two = select_profile(
        published[:2] if order == 1 else published[2:], card=H100, node=None, conditions={}
    )
    assert two is not None and (two.profile_id, two.rests_on) == ("p-32", "n2")
    assert two.basis.startswith("rests on node n2 alone: the more conservative of 2 nodes")


def test_a_mig_slice_is_its_own_card() -> None:
    whole = ("whole", profile(H100, "n1"))
    mig = (
        "mig",
        profile(f"{H100} MIG 1g.10gb", "n2", total_memory_bytes=10 * GIB, capacity_bytes=10 * GIB),
    )

    for card, mig_profile in [("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", None), (H100, "1g.10gb")]:
        chosen = select_profile(
            [mig, whole], card=card, node=None, conditions={}, mig_profile=mig_profile
        )
        assert chosen is not None and (chosen.profile_id, chosen.match) == ("mig", "measured")
    chosen = select_profile([mig, whole], card=H100, node=None, conditions={})
    assert chosen is not None and chosen.profile_id == "whole"


def test_a_condition_asked_in_another_spelling_of_its_value_matches() -> None:
    # The CLI's --amp bf16 and torch's torch.bfloat16 name what a profile records as bfloat16.
    recorded = Conditions(device_type="cuda", amp_dtype="bfloat16")
    for asked in ("bfloat16", "bf16", "BF16", "torch.bfloat16"):
        assert condition_mismatches(recorded, {"amp_dtype": asked}) == [], asked
    assert condition_mismatches(recorded, {"amp_dtype": "fp16"}) == [
        "amp_dtype: recorded 'bfloat16', asked 'float16'"
    ]


def test_an_unknown_condition_is_named_with_the_names_to_use_in_words() -> None:
    with pytest.raises(ConfigError) as raised:
        condition_mismatches(Conditions(device_type="cuda"), {"foo": "bar"})
    message = str(raised.value)
    assert message.startswith("unknown condition(s) 'foo': name conditions from ")
    assert "'amp_dtype', " in message and "'world_size'" in message and "[" not in message
