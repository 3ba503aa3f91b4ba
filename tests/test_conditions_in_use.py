"""Every place that uses a plan checks the conditions it was measured under against the live
process: the store lookup (re-probes and says why), ``autobatch.plan(profile)``, the
Accumulator; the world size comes from the launcher before the process group exists; a
refusal never suggests a setting already in effect; noise never picks the split."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import autobatch
from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConditionsWarning, ConfigError, DoesNotFitError
from tests.planning.test_planner import plan as plan_for_another_process

SAMPLE = (torch.randn(2, 64), torch.randint(0, 10, (2,)))


class CudaLikeDevice(SimulatedDevice):
    """A simulated card that reports itself as CUDA, so that the conditions that move memory
    only on CUDA (the allocator settings, cuDNN's flags) are recorded and compared for it."""

    @property
    def type(self) -> str:
        return "cuda"


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def tune(tmp_path: Path, model: torch.nn.Module | None = None, **options: Any) -> autobatch.Plan:
    arguments: dict[str, Any] = {
        "effective_batch_size": 64,
        "loss_fn": F.cross_entropy,
        "device": CudaLikeDevice(capacity_bytes=4 << 20),
        "store": tmp_path / "profiles.sqlite3",
        "max_micro_batch_size": 64,
        **options,
    }
    return autobatch.autotune(model if model is not None else mlp(), SAMPLE, **arguments)


# --- the store lookup --------------------------------------------------------------------------


def test_a_cudnn_flag_change_probes_again_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    first = tune(tmp_path)
    assert first.source == "measured"
    assert tune(tmp_path).source == "cached"

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        second = tune(tmp_path)

    assert second.source == "measured"
    why = "cudnn.benchmark: measured with False, this process has True"
    assert any(why in note for note in second.notes)
    assert why in caplog.text
    assert second.conditions.cudnn["benchmark"] == "True"
    assert tune(tmp_path).source == "cached"  # now stored under the new conditions
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert tune(tmp_path).source == "cached"  # and the first profile still answers its own


def test_an_allocator_variable_set_after_torch_read_its_settings_is_not_served_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, set_allocator: Callable[[str], None]
) -> None:
    # Measured with expandable segments in effect; then a run whose variable was set after
    # CUDA initialised (torch runs its defaults): the stored plan no longer holds.
    set_allocator("expandable_segments:True")
    assert tune(tmp_path).conditions.allocator_settings == "expandable_segments:True"
    set_allocator("")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")

    again = tune(tmp_path)

    assert again.source == "measured"
    (why,) = [note for note in again.notes if "allocator settings in effect" in note]
    assert "measured with 'expandable_segments:True', this process has 'torch defaults'" in why
    assert "PYTORCH_ALLOC_CONF='expandable_segments:True' is set but not in effect" in why


def test_the_same_settings_under_the_other_variable_name_are_one_condition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, set_allocator: Callable[[str], None]
) -> None:
    set_allocator("expandable_segments:True")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    tune(tmp_path)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments: True")  # torch read it

    assert tune(tmp_path).source == "cached"


def test_allocator_settings_do_not_apply_on_a_simulated_card(
    tmp_path: Path, set_allocator: Callable[[str], None]
) -> None:
    device = SimulatedDevice(capacity_bytes=4 << 20)
    tune(tmp_path, device=device)
    set_allocator("expandable_segments:True")
    assert tune(tmp_path, device=device).source == "cached"


class Flagged(torch.nn.Module):
    """An MLP with Hugging Face's ``gradient_checkpointing`` flag; ``checkpoints`` says whether
    its forward honours it."""

    checkpoints = True

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.head = torch.nn.Linear(64, 10)
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing and self.checkpoints and self.training:
                x = checkpoint(_block, layer, x, use_reentrant=False)
            else:
                x = _block(layer, x)
        return self.head(x)  # type: ignore[no-any-return]


class FlaggedInVain(Flagged):
    checkpoints = False


def _block(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(x)) * torch.sigmoid(x)


@pytest.mark.slow
@pytest.mark.parametrize(("cls", "warned"), [(FlaggedInVain, True), (Flagged, False)])
def test_checkpointing_that_changes_nothing_is_warned_about(
    tmp_path: Path, cls: type[Flagged], warned: bool
) -> None:
    options: dict[str, Any] = {
        "device": SimulatedDevice(capacity_bytes=1 << 20),
        "max_micro_batch_size": 256,
        "effective_batch_size": 256,
    }
    plain = tune(tmp_path, cls(), **options)
    model = cls()
    model.gradient_checkpointing = True
    if warned:
        with pytest.warns(ConditionsWarning, match="activation checkpointing changed nothing"):
            checkpointed = tune(tmp_path, model, **options)
    else:
        checkpointed = tune(tmp_path, model, **options)  # a warning would fail the test
        assert checkpointed.max_micro_batch_size > plain.max_micro_batch_size
    assert checkpointed.source == "measured"
    assert any(
        "activation checkpointing: measured with none detected" in n for n in checkpointed.notes
    )
    assert checkpointed.conditions.activation_checkpointing == (
        "Hugging Face gradient_checkpointing on 1 modules"
    )


# --- the launcher's world size -----------------------------------------------------------------


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment torchrun gives rank 0 of two, before the script creates a group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


def test_autotune_under_torchrun_before_the_group_plans_for_the_launchers_ranks(
    tmp_path: Path, torchrun: None
) -> None:
    plan = tune(tmp_path, effective_batch_size=16, device="sim:4MiB")

    assert plan.world_size == 2
    assert sum(plan.micro_batch_sizes) * 2 == 16
    assert plan.conditions.world_size == 2
    source = "the launcher's environment (WORLD_SIZE=2, RANK=0, LOCAL_RANK=0)"
    assert plan.conditions.world_size_source == source
    assert any(source in note and "did not agree" in note for note in plan.notes)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_live_group_is_planned_for_and_a_launcher_that_disagrees_is_named(
    tmp_path: Path, torchrun: None, one_rank_group: None
) -> None:
    plan = tune(tmp_path, effective_batch_size=16, device="sim:4MiB")
    assert plan.world_size == 1  # the group trains: each process alone
    assert plan.conditions.world_size_source == (
        "the default process group (world size 1, gloo); the launcher's environment "
        "(WORLD_SIZE=2, RANK=0, LOCAL_RANK=0) says 2, which counts something else (pods, tasks)"
    )


# --- plan(profile) ------------------------------------------------------------------------------


def test_plan_of_a_profile_in_a_process_with_other_cudnn_flags_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    profile = autobatch.probe(
        mlp(), SAMPLE, loss_fn=F.cross_entropy, device=CudaLikeDevice(capacity_bytes=4 << 20)
    )
    quiet = autobatch.plan(profile, effective_batch_size=64)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)

    with pytest.warns(ConditionsWarning, match="cudnn.benchmark: measured with False, this pro"):
        loud = autobatch.plan(profile, effective_batch_size=64)

    assert loud.micro_batch_sizes == quiet.micro_batch_sizes
    assert any("cudnn.benchmark" in note for note in loud.notes)
    assert not any("cudnn.benchmark" in note for note in quiet.notes)
    # Planned for another card, or by the service for another process: not this process's.
    autobatch.plan(profile, effective_batch_size=64, capacity_bytes=8 << 20)
    plan_for_another_process(profile, effective_batch_size=64)


def test_plan_without_a_world_size_under_torchrun_warns(torchrun: None) -> None:
    with pytest.warns(ConditionsWarning, match="world_size: the plan is for 1 data-parallel"):
        autobatch.plan(24, effective_batch_size=48)
    autobatch.plan(24, effective_batch_size=48, world_size=2)  # said: not warned


# --- the Accumulator ---------------------------------------------------------------------------


def test_the_accumulator_refuses_a_plan_for_another_world_size() -> None:
    model = mlp()
    plan = autobatch.plan(8, effective_batch_size=16, world_size=2)
    with pytest.raises(ConfigError, match=r"world_size: the plan is for 2 data-parallel ranks, "):
        autobatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)


def test_the_accumulator_under_torchrun_takes_the_launchers_world_size(torchrun: None) -> None:
    model = mlp()
    plan = autobatch.plan(8, effective_batch_size=32, world_size=2)
    accumulator = autobatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan
    )
    assert accumulator.gradient_accumulation_steps == 2


def test_the_accumulator_warns_when_the_model_changed_since_it_was_measured(
    tmp_path: Path,
) -> None:
    model = mlp()
    plan = tune(tmp_path, model, device="sim:4MiB")
    optimizer = torch.optim.AdamW(model.parameters())
    autobatch.Accumulator(model, optimizer, plan=plan)  # as measured: silent

    model.to(torch.bfloat16)
    with pytest.warns(ConditionsWarning) as warned:
        autobatch.Accumulator(model, optimizer, plan=plan)
    said = [str(w.message).split("may not fit: ")[1].split(",")[0] for w in warned]
    assert said == [
        "parameter bytes: measured with 75.04 KiB float32",
        "gradient bytes: measured with 75.04 KiB float32",
    ]


def test_the_accumulator_warns_about_the_optimizer_it_was_not_measured_with(
    tmp_path: Path,
) -> None:
    model = mlp()
    plan = tune(tmp_path, model, device="sim:4MiB")  # the probe's own AdamW
    with pytest.warns(ConditionsWarning, match=r"optimizer: measured with torch.optim.adamw.AdamW"):
        autobatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)


def test_the_accumulator_checks_cudnn_for_a_cuda_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    model = mlp()
    plan = tune(tmp_path, model)
    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    with pytest.warns(ConditionsWarning, match="set torch.backends.cudnn.benchmark = True"):
        autobatch.Accumulator(model, optimizer, plan=plan)


def test_the_accumulator_steps_must_agree_with_the_plans() -> None:
    model = mlp()
    plan = autobatch.plan(8, effective_batch_size=16)
    with pytest.raises(ConfigError, match="disagrees with the plan's 2"):
        autobatch.Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            plan=plan,
            gradient_accumulation_steps=4,
        )


# --- refusals and the throughput rule ------------------------------------------------------------


def test_a_bf16_refusal_never_suggests_the_amp_dtype_already_set() -> None:
    # AMP on, parameters fp32 (from_pretrained without a dtype): refused, rightly, but the fix
    # is the parameters' dtype, not amp_dtype=torch.bfloat16 again.
    model = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.Linear(2048, 10))
    options: dict[str, Any] = {"loss_fn": F.cross_entropy, "device": "sim:1MiB"}
    with pytest.raises(DoesNotFitError) as refused:
        autobatch.probe(model, SAMPLE, amp_dtype=torch.bfloat16, **options)
    said = str(refused.value)
    assert "amp_dtype=torch.bfloat16" not in said
    assert all(remedy.parameter != "amp_dtype" for remedy in refused.value.remedies)
    assert "parameters stored in bfloat16" in said
    with pytest.raises(DoesNotFitError) as without_amp:
        autobatch.probe(model, SAMPLE, **options)
    # Without AMP, the weights, gradients and AdamW state alone (about 2.3 MiB) exceed 1 MiB:
    # autocast shrinks none of them, so it is not offered.
    assert "the fixed state alone takes more than the 1.00 MiB capacity" in str(without_amp.value)
    assert "amp_dtype" not in str(without_amp.value)


def test_repeated_tuning_of_a_tiny_model_gives_one_answer() -> None:
    # E=256: one warm-up and timings taken once on a loaded machine could choose 1 x 256; a
    # split is chosen by throughput only on timings that settle it.
    model = torch.nn.Linear(8, 2)
    sample = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    answers = {
        autobatch.autotune(
            model,
            sample,
            effective_batch_size=256,
            loss_fn=F.cross_entropy,
            device="sim:64MiB",
            use_store=False,
        ).micro_batch_sizes
        for _ in range(3)
    }
    assert answers == {(256,)}
