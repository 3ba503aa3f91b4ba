"""A step that does not fit at micro-batch 1 gets the remedies of what binds: the fixed state
(weights, gradients, optimizer state), which autocast does not shrink, or the activations."""

from __future__ import annotations

from autobatch.cli._wording import cli_remedies, flag_wording
from autobatch.conditions import Conditions
from autobatch.errors import Remedy, with_remedies
from autobatch.probing._trial_failures import what_binds

GIB, MIB = 2**30, 2**20


def test_fixed_state_that_fills_the_card_is_said_with_numbers_and_no_autocast() -> None:
    # gpt2 at --seq-len 64 on sim:2GiB: 1.85 GiB of weights, gradients and AdamW state.
    static = int(1.85 * GIB)
    why, remedies = what_binds(static, 2 * GIB, Conditions(amp_dtype="off"))
    assert why == (
        ": the fixed state alone takes 92% of the capacity, leaving 153.60 MiB for activations "
        "and the optimizer step's temporaries, and autocast and activation checkpointing "
        "shrink only activations"
    )
    assert all(r.parameter != "amp_dtype" for r in remedies)
    assert [r.purpose for r in remedies] == [
        "a larger device",
        "an optimizer that keeps less state (SGD none, AdamW two copies)",
        "a smaller model",
    ]
    over, _ = what_binds(3 * GIB, 2 * GIB, Conditions(amp_dtype="off"))
    assert over.startswith(": the fixed state alone takes more than the 2.00 GiB capacity,")


def test_activations_that_bind_keep_reduced_precision_first() -> None:
    why, remedies = what_binds(512 * MIB, 2 * GIB, Conditions(amp_dtype="off"))
    assert why == ""
    assert remedies[1] == Remedy(
        parameter="amp_dtype", values=("bfloat16",), purpose="reduced precision"
    )


def test_the_cli_never_offers_a_python_only_remedy() -> None:
    remedies = [
        Remedy(purpose="a larger device"),
        Remedy(
            purpose="parameters stored in bfloat16 (load them with "
            "from_pretrained(torch_dtype=torch.bfloat16) or model.to(torch.bfloat16))"
        ),
        Remedy(parameter="amp_dtype", values=("bfloat16",), purpose="reduced precision"),
    ]
    words = with_remedies("does not fit", cli_remedies(remedies), flag_wording)
    assert words == "does not fit; use a larger device, or --amp bf16 (reduced precision)"
