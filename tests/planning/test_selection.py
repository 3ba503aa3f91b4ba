"""Which stored profile answers a plan for a card type or a node (planning.selection)."""

from __future__ import annotations

from typing import Any

import pytest

from autobatch.conditions import Conditions
from autobatch.errors import ConfigError
from autobatch.planning import condition_mismatches, select_profile
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


# Newest first, as the store lists them.
STORE = [
    ("a100-n3-fp16", profile(A100, "n3", FP16)),
    ("h100-n2-fp16", profile(H100, "n2", FP16)),
    ("h100-n1-bf16", profile(H100, "n1", BF16)),
    ("a100-n4-bf16", profile(A100, "n4", BF16)),
    ("h100-n0-bf16-old", profile(H100, "n0", BF16)),
]


@pytest.mark.parametrize(
    ("card", "node", "conditions", "profile_id", "match"),
    [
        # The newest profile of the card under the conditions asked, on any node: measured.
        (H100, None, {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "measured"),
        (H100, None, {"amp_dtype": "float16"}, "h100-n2-fp16", "measured"),
        # No conditions asked: the card's newest.
        (H100, None, {}, "h100-n2-fp16", "measured"),
        # The node's own profile first, even when the card has a newer one elsewhere.
        (H100, "n0", {"amp_dtype": "bfloat16"}, "h100-n0-bf16-old", "measured"),
        # The node has none under these conditions: the card's, on another node, is measured.
        (H100, "n2", {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "measured"),
        # A node alone: its card is the one its profiles were measured on.
        (None, "n4", {}, "a100-n4-bf16", "measured"),
        (None, "n3", {"amp_dtype": "bfloat16"}, "a100-n4-bf16", "measured"),
        # The card only under other conditions: predicted from the card's profile.
        (A100, None, {"amp_dtype": "bfloat16", "optimizer": "x.SGD"}, "a100-n3-fp16", "predicted"),
        # A card with no profile: the model's newest under the conditions asked, predicted.
        ("NVIDIA L4", None, {"amp_dtype": "bfloat16"}, "h100-n1-bf16", "predicted"),
        ("NVIDIA L4", None, {}, "a100-n3-fp16", "predicted"),
        # An unknown node with no card: predicted, and it says the node's card is unknown.
        (None, "n9", {}, "a100-n3-fp16", "predicted"),
    ],
)
def test_select_profile_ranks_card_node_and_conditions(
    card: str | None, node: str | None, conditions: dict[str, Any], profile_id: str, match: str
) -> None:
    chosen = select_profile(STORE, card=card, node=node, conditions=conditions)

    assert chosen is not None
    assert (chosen.profile_id, chosen.match) == (profile_id, match)
    assert bool(chosen.reasons) == (match == "predicted")


def test_predicted_selection_names_where_it_was_measured_and_what_differs() -> None:
    chosen = select_profile(STORE, card="NVIDIA L4", node=None, conditions={"amp_dtype": "float16"})

    assert chosen is not None
    assert chosen.profile_id == "a100-n3-fp16"
    assert chosen.reasons == (f"measured on {A100} (node n3), not NVIDIA L4",)
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
    with pytest.raises(ConfigError, match=r"unknown condition\(s\) \['amp'\].*amp_dtype"):
        select_profile(STORE, card=H100, node=None, conditions={"amp": "bf16"})
    with pytest.raises(ConfigError, match="unknown condition"):
        select_profile([], card=H100, node=None, conditions={"amp": "bf16"})
