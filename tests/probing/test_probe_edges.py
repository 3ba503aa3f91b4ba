"""Edge cases found by trying to break the probe: each one a fault that was fixed."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autobatch
from autobatch import SimulatedDevice, autotune, estimate, probe
from autobatch.errors import AutobatchError, ConfigError, StepFailedError
from autobatch.tuning import autotune_profile


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


# -- the cache answers only an equal request ------------------------------------------------


def test_cache_misses_when_another_process_took_memory(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    model, x = mlp(), torch.randn(4, 256)
    alone = SimulatedDevice(capacity_bytes=24 << 20)
    busy = SimulatedDevice(capacity_bytes=24 << 20, foreign_memory_bytes=8 << 20)
    first = autotune_profile(model, x, loss_fn=square_loss, device=alone, store=store)
    assert not first.cached
    second = autotune_profile(model, x, loss_fn=square_loss, device=busy, store=store)
    assert not second.cached
    assert second.profile.max_micro_batch_size < first.profile.max_micro_batch_size
    again = autotune_profile(model, x, loss_fn=square_loss, device=busy, store=store)
    assert again.cached and again.profile_id == second.profile_id
    assert again.profile.max_micro_batch_size == second.profile.max_micro_batch_size
    freed = autotune_profile(model, x, loss_fn=square_loss, device=alone, store=store)
    assert not freed.cached  # the newest profile was probed with less room: probe again
    assert freed.profile.max_micro_batch_size == first.profile.max_micro_batch_size


@pytest.mark.parametrize(
    "change",
    ["loss_fn", "optimizer_hyperparameters", "input_dtype"],
)
def test_cache_misses_when_the_step_differs(tmp_path: Path, change: str) -> None:
    store = tmp_path / "s.sqlite3"
    model = mlp()
    base: dict[str, Any] = {
        "loss_fn": F.cross_entropy,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "device": "sim:16MiB",
        "store": store,
    }
    sample = (torch.randn(4, 256), torch.randint(0, 256, (4,)))
    autotune_profile(model, sample, **base)
    changed = dict(base)
    if change == "loss_fn":
        changed["loss_fn"] = lambda out, target: F.cross_entropy(out.exp(), target)
    elif change == "optimizer_hyperparameters":
        changed["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        sample = (sample[0], sample[1].to(torch.uint8))
    assert not autotune_profile(model, sample, **changed).cached


def test_a_profile_cut_short_by_a_non_oom_failure_is_not_cached(tmp_path: Path) -> None:
    calls = {"real": 0}

    def flaky(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(batch, FakeTensor):
            calls["real"] += 1
            if calls["real"] == 2:
                raise RuntimeError("transient driver hiccup")
        return m(batch).pow(2).mean()

    # A card whose real steps are dear (1 s each on its clock), so the estimate runs first.
    kwargs: dict[str, Any] = {
        "device": SimulatedDevice(capacity_bytes=16 << 20),
        "store": tmp_path / "s.sqlite3",
    }
    model, x = mlp(), torch.randn(4, 256)
    first = autotune(model, x, train_step=flaky, effective_batch_size=256, **kwargs)
    # the failure (at 256, the trial after the warm-up) bounded the search: 255 ran
    assert (first.micro_batch_size, first.gradient_accumulation_steps) == (128, 2)
    assert any("256 failed for a reason other than memory" in note for note in first.notes)
    second = autotune(model, x, train_step=flaky, effective_batch_size=256, **kwargs)
    assert second.source == "measured"  # not served from the cache
    assert second.micro_batch_size == 256


# -- nothing is lost ---------------------------------------------------------------------


def test_optimizer_state_keeps_its_own_dtype_and_identity() -> None:
    class Master(torch.optim.Optimizer):
        """Keeps a float32 master copy of bfloat16 parameters."""

        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state["master"] = p.detach().float().clone()
                    state["master"].add_(p.grad.float(), alpha=-group["lr"])
                    p.copy_(state["master"])

    model = nn.Linear(64, 64).to(torch.bfloat16)
    optimizer = Master(model.parameters())
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    master = optimizer.state[model.weight]["master"]
    saved = master.clone()
    probe(
        model, x, optimizer=optimizer, loss_fn=lambda o: o.float().pow(2).mean(), device="sim:8MiB"
    )
    after = optimizer.state[model.weight]["master"]
    assert after is master and after.dtype == torch.float32 and torch.equal(after, saved)


def test_parameters_the_optimizer_steps_outside_the_model_are_restored() -> None:
    model, head = nn.Linear(8, 8), nn.Linear(8, 4)
    optimizer = torch.optim.Adam([*model.parameters(), *head.parameters()])
    before = head.weight.detach().clone()
    probe(
        model,
        (torch.randn(4, 8), torch.randint(0, 4, (4,))),
        optimizer=optimizer,
        loss_fn=lambda out, target: F.cross_entropy(head(out), target),
        device="sim:4MiB",
    )
    assert torch.equal(head.weight, before)
    assert not optimizer.state


def test_a_callable_sample_does_not_move_the_rng(tmp_path: Path) -> None:
    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 8), torch.randint(0, 4, (n,))

    model = nn.Linear(8, 4)
    torch.manual_seed(1)
    random.seed(1)
    expected = (torch.rand(3), random.random())
    for call in (
        lambda: probe(model, make, loss_fn=F.cross_entropy, device="sim:1MiB"),
        lambda: estimate(model, make, loss_fn=F.cross_entropy, capacity_bytes=1 << 20),
        lambda: autotune_profile(
            model, make, loss_fn=F.cross_entropy, device="sim:1MiB", store=tmp_path / "s"
        ),
        lambda: autotune_profile(
            model, make, loss_fn=F.cross_entropy, device="sim:1MiB", store=tmp_path / "s"
        ),
    ):
        torch.manual_seed(1)
        random.seed(1)
        call()
        got = (torch.rand(3), random.random())
        assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_estimate_leaves_no_fake_gradient_on_a_model_a_train_step_closes_over() -> None:
    model = nn.Linear(8, 8)
    estimate(
        model, torch.randn(2, 8), capacity_bytes=1 << 20, train_step=lambda m, b: model(b).sum()
    )
    assert model.weight.grad is None


# -- arguments that would probe the wrong step --------------------------------------------


def test_step_includes_update_needs_the_optimizer() -> None:
    with pytest.raises(ConfigError, match="step_includes_update=True needs optimizer"):
        probe(
            nn.Linear(4, 4),
            torch.randn(2, 4),
            train_step=lambda m, b: m(b).sum(),
            step_includes_update=True,
            device="sim:1MiB",
        )


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="holds none of the model's parameters"):
        probe(
            model,
            torch.randn(2, 4),
            optimizer=torch.optim.Adam(nn.Linear(4, 4).parameters()),
            loss_fn=square_loss,
            device="sim:1MiB",
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amp_dtype": torch.int8}, "not an autocast dtype"),
        ({"amp_dtype": "bf16"}, "not an autocast dtype"),
        ({"optimizer": "adam"}, "not a torch.optim.Optimizer"),
        ({"safety_margin": "0.05"}, "safety_margin"),
        ({"device": "simx:1GiB"}, "not understood"),
        ({"device": "sim:1.5"}, "fraction of a byte"),
    ],
)
def test_wrong_kinds_of_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        probe(
            nn.Linear(4, 4),
            torch.randn(2, 4),
            loss_fn=square_loss,
            **{"device": "sim:1MiB", **kwargs},
        )


def test_a_train_step_that_calls_backward_itself_gets_a_hint() -> None:
    def step(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        loss = m(b).pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(StepFailedError, match="step_includes_update=True"):
        probe(
            nn.Linear(4, 4),
            torch.randn(2, 4),
            train_step=step,
            device="sim:1MiB",
            use_estimate=False,
        )


# -- models and samples with an edge of their own -------------------------------------------


def test_batchnorm1d_model_is_probed_from_two_samples() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    profile = probe(
        model,
        (torch.randn(4, 8), torch.randint(0, 4, (4,))),
        loss_fn=F.cross_entropy,
        device=SimulatedDevice(capacity_bytes=1 << 20),  # dear steps: the estimate runs
    )
    assert profile.method == "probe" and profile.max_micro_batch_size > 2
    assert any("warmed up at 2" in note for note in profile.notes)


def test_fp16_overflow_still_creates_the_optimizer_state() -> None:
    # At the scaler's initial scale the fp16 gradients of this loss overflow; a training loop
    # would skip the step. The probe must still measure with Adam's moments present.
    # (The loss's gradient, 10 at every output, is 655,360 at the initial scale of 65,536: past
    # fp16's 65,504 whatever the width, so a narrow model overflows as a wide one does.)
    model, x = (
        nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)),
        torch.randn(4, 256),
    )
    overflowing = probe(
        model,
        x,
        loss_fn=lambda o: o.float().sum() * 10,
        amp_dtype=torch.float16,
        device="sim:8MiB",
    )
    plain = probe(
        model, x, loss_fn=lambda o: o.float().mean(), amp_dtype=torch.float16, device="sim:8MiB"
    )
    assert overflowing.max_micro_batch_size == plain.max_micro_batch_size
    assert overflowing.method == plain.method == "probe"  # the estimate runs under fp16 too


def test_hugging_face_batch_encoding_sample() -> None:
    from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    )
    ids = torch.randint(0, 128, (2, 16))
    profile = probe(model, BatchEncoding({"input_ids": ids, "labels": ids}), device="sim:32MiB")
    assert profile.max_micro_batch_size > 1
    assert profile.input_dtypes == {"input_ids": "int64", "labels": "int64"}


def test_estimate_unavailable_is_an_autobatch_error() -> None:
    assert issubclass(autobatch.EstimateUnavailableError, AutobatchError)
