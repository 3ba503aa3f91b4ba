"""Activation checkpointing chosen with the micro-batch on the tuning road
(:mod:`autobatch.tuning._checkpointing`), on a tiny GPT-2 and simulated cards: a model whose
micro-batch 1 does not fit gets a plan with ``"auto"`` and, without it, an error naming that
plan; a probe that does not choose checkpointing leaves the model's modules as they were; each
mode's profile has its own key in the store."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from autobatch.errors import ConfigError, DoesNotFitError
from autobatch.probing import apply_activation_checkpointing
from autobatch.profile import Profile
from autobatch.tuning import TuneRequest, Tuning, report_data, report_html, tune, tune_request

transformers = pytest.importorskip("transformers")

TOO_SMALL_FOR_PLAIN = "sim:1100KiB"
"""Micro-batch 1 of :func:`_model` peaks at about 1.13 MiB without checkpointing (the measured
step with the optimizer state present), 0.92 MiB with full checkpointing: this card holds only
the checkpointed one."""


def _tune(model: torch.nn.Module, sample: Any, **options: Any) -> Tuning:
    """:func:`autobatch.tuning.tune`'s road, searching by doubling (no fake-tensor estimate:
    a few times faster on these tiny steps)."""
    return tune_request(TuneRequest.build(model, sample, use_estimate=False, **options))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def sample() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_micro_batch_1_not_fitting_plain_gets_a_plan_with_auto_and_an_error_without(
    model: torch.nn.Module, sample: Any
) -> None:
    with pytest.raises(DoesNotFitError) as caught:
        _tune(model, sample, effective_batch_size=16, device=TOO_SMALL_FOR_PLAIN, use_store=False)
    text = str(caught.value)
    assert "does not fit on sim even at micro-batch 1" in text
    assert "with activation checkpointing 'full' it fits: micro_batch_size 1 x 16" in text
    assert "use activation_checkpointing='auto' (choose activation checkpointing" in text

    modules = list(model.modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tuned = _tune(
        model,
        sample,
        effective_batch_size=16,
        device=TOO_SMALL_FOR_PLAIN,
        use_store=False,
        activation_checkpointing="auto",
    )
    plan = tuned.plan
    assert plan.activation_checkpointing in ("selective", "full")
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 16
    assert tuned.profile.activation_checkpointing == plan.activation_checkpointing
    assert "autobatch checkpoint on" in tuned.profile.conditions.activation_checkpointing
    outcome = tuned.checkpointing
    assert outcome is not None
    assert outcome.tried == ("none", "selective", "full")
    assert outcome.why_tried == "no micro-batch fits without checkpointing"
    assert "activation checkpointing none: no plan (largest micro-batch 0)" in plan.notes
    # The plan's micro-batch ran and fitted under the chosen mode (measured, not predicted).
    ran = [t for t in tuned.profile.trials if t.micro_batch_size == plan.micro_batch_size]
    assert any(t.fits for t in ran)
    # Three probes with blocks checkpointed and undone: the same modules, the same state.
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(a is b for a, b in zip(modules, model.modules(), strict=True))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    # The report draws every mode's trials, the OOMs marked, and the chosen point.
    data = report_data(tuned)
    assert [m["mode"] for m in data["modes"]] == ["selective", "full"]  # none has no profile
    assert data["chosen"]["activation_checkpointing"] == plan.activation_checkpointing
    page = report_html(tuned)
    ooms = sum(t.oom for _, p in _profiles(tuned) for t in p.trials if not t.warm_up)
    assert ooms > 0 and page.count('class="trial oom"') == ooms
    assert f'id="chosen-point" class="chosen" data-mode="{plan.activation_checkpointing}"' in page


def _profiles(tuned: Tuning) -> list[tuple[str, Profile]]:
    assert tuned.checkpointing is not None
    return [(r.mode, r.profile) for r in tuned.checkpointing.runs if r.profile is not None]


def test_a_probe_that_does_not_choose_checkpointing_leaves_the_model_as_it_was(
    model: torch.nn.Module, sample: Any
) -> None:
    modules = list(model.modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tuned = _tune(
        model,
        sample,
        effective_batch_size=2,
        device="sim:3MiB",
        use_store=False,
        activation_checkpointing="auto",
    )
    assert tuned.plan.activation_checkpointing == "none"
    assert (tuned.plan.micro_batch_size, tuned.plan.gradient_accumulation_steps) == (2, 1)
    outcome = tuned.checkpointing
    assert outcome is not None
    assert outcome.tried == ("none",)  # one micro-step: nothing to gain, nothing probed
    assert "skipped selective, full" in tuned.plan.notes[-2]
    assert "in one micro-step" in outcome.why_tried
    assert all(a is b for a, b in zip(modules, model.modules(), strict=True))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_each_mode_has_its_own_profile_in_the_store(
    model: torch.nn.Module, sample: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "profiles.sqlite3"
    caplog.set_level("WARNING", logger="autobatch")

    def tuned(mode: str) -> Any:
        return _tune(
            model,
            sample,
            effective_batch_size=16,
            device="sim:3MiB",
            store=store,
            activation_checkpointing=mode,
        )

    full = tuned("full")
    assert (full.plan.source, full.plan.activation_checkpointing) == ("measured", "full")
    plain = tuned("none")  # not answered by the full profile
    assert (plain.plan.source, plain.plan.activation_checkpointing) == ("measured", "none")
    assert plain.profile_id != full.profile_id
    assert plain.profile.max_micro_batch_size < full.profile.max_micro_batch_size
    again = tuned("full")
    assert (again.plan.source, again.profile_id) == ("cached", full.profile_id)
    assert again.profile.activation_checkpointing == "full"
    # Applied by hand, the same mode finds the same profile: the key is what recomputes.
    undo = apply_activation_checkpointing(model, "full")
    try:
        by_hand = tuned("none")
    finally:
        undo()
    assert by_hand.profile_id == full.profile_id
    # Each mode's neighbour in the store is by design: no "measured under other conditions,
    # probed again" about a mode autobatch applied (a fresh user saw one per mode).
    assert not [r for r in caplog.records if "under other conditions" in r.getMessage()]


def test_an_old_profile_reads_as_no_checkpointing_and_bad_options_are_refused(
    model: torch.nn.Module, sample: Any
) -> None:
    tuned = _tune(model, sample, effective_batch_size=2, device="sim:3MiB", use_store=False)
    data = tuned.profile.to_dict()
    assert data["activation_checkpointing"] == "none"
    del data["activation_checkpointing"]
    assert Profile.from_dict(data).activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="activation_checkpointing='most' is not a choice"):
        tune(model, sample, effective_batch_size=2, activation_checkpointing="most")
    with pytest.raises(ConfigError, match="checkpoint_block_class='Nope' matches no module"):
        tune(
            model,
            sample,
            effective_batch_size=2,
            activation_checkpointing="auto",
            checkpoint_block_class="Nope",
        )


def test_auto_on_a_model_without_repeated_blocks_plans_it_as_given_and_says_why() -> None:
    # "Asked for, never imposed": with nothing to checkpoint, "auto" is the plain plan.
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    tuned = _tune(
        mlp,
        torch.randn(2, 8),
        loss_fn=lambda out: out.pow(2).mean(),
        effective_batch_size=16,
        device="sim:1MiB",
        use_store=False,
        activation_checkpointing="auto",
    )
    assert tuned.plan.activation_checkpointing == "none"
    assert tuned.checkpointing is not None and tuned.checkpointing.tried == ("none",)
    assert any(
        "tried none; skipped selective, full: nothing to checkpoint: " in note
        for note in tuned.plan.notes
    ), tuned.plan.notes
    # A block class the user names still has to match.
    with pytest.raises(ConfigError, match="checkpoint_block_class='Nope' matches no module"):
        _tune(mlp, torch.randn(2, 8), effective_batch_size=16, device="sim:1MiB",
              activation_checkpointing="auto", checkpoint_block_class="Nope")  # fmt: skip


def test_the_notes_and_the_report_agree_on_which_modes_were_timed(
    model: torch.nn.Module, sample: Any
) -> None:
    # With the estimate, the plain probe's first trial is at micro-batch 2 (the one size timed)
    # while its plan is 1 x 9: the notes once called that mode's time "not measured" while the
    # report plotted it. Both read the same times now, and the notes say how they were drawn.
    tuned = tune_request(
        TuneRequest.build(
            model,
            sample,
            effective_batch_size=9,
            device="sim:2MiB",
            use_store=False,
            activation_checkpointing="auto",
        )
    )
    data = report_data(tuned)
    plotted = {
        m["mode"] for m in data["modes"] if any(t["seconds_per_sample"] for t in m["trials"])
    }
    lines = {
        note.split(": ")[0].removeprefix("activation checkpointing "): note
        for note in data["why"][2:]  # one line per mode after the choice and what was tried
    }
    assert set(lines) == {"none", "selective", "full"}
    planned = {mode for mode, line in lines.items() if " steps, " in line}
    assert planned and planned <= plotted
    for mode in planned:
        assert ("time not measured" in lines[mode]) == (mode not in plotted), lines[mode]
    plain = lines["none"]
    assert "micro-batch 1 \u00d7 9 steps" in plain
    # The plan's own micro-batch 1 was timed by 3 trials more (the search never timed it),
    # so the time is measured there, no bound, with the steps' spread (its noise, shown when
    # above 0); the report plots those trials too.
    assert re.search(
        r"s per optimizer step(, measured noise \d+%)? \(largest micro-batch 2, ", plain
    )
    assert "at least" not in plain and "at most" not in plain
    none = next(m for m in data["modes"] if m["mode"] == "none")
    timed_at_1 = [
        t for t in none["trials"] if t["micro_batch_size"] == 1 and t["seconds_per_sample"]
    ]
    assert len(timed_at_1) == 3  # the 3 timing trials (the warm-up at 1 is left out)
    assert data["why"] == [n for n in tuned.plan.notes if n.startswith("activation checkpointing")]
