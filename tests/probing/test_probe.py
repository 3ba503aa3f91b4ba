"""The probe end to end on the simulated device with real models."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError, DoesNotFitError, StepFailedError
from autobatch.probing._batch import BatchSource
from autobatch.probing._prober import probe
from autobatch.probing._step import TrainingStep
from tests.conftest import ModelCase, exhaustive_max

UNIT = 16384  # float32 elements; one unit = 64 KiB


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in the process (a gc scan)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "tensors": [t.detach().clone() for t in [*model.parameters(), *model.buffers()]],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "flags": [m.training for m in model.modules()],
        "optimizer": optimizer.state_dict(),
        "rng_torch": torch.get_rng_state(),
        "rng_python": random.getstate(),
    }


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    for a, b in zip(before["tensors"], after["tensors"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(before["grads"], after["grads"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert before["flags"] == after["flags"]
    assert torch.equal(before["rng_torch"], after["rng_torch"])
    assert before["rng_python"] == after["rng_python"]
    opt_a, opt_b = before["optimizer"], after["optimizer"]
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, per_param in opt_a["state"].items():
        for name, value in per_param.items():
            other = opt_b["state"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


@pytest.mark.slow
def test_found_max_equals_exhaustive_max_and_leaves_no_trace(
    model_case: ModelCase, sim_capacity_for: Callable[[ModelCase, int], int]
) -> None:
    capacity = sim_capacity_for(model_case, 24)
    expected = exhaustive_max(model_case, capacity)
    model, sample, optimizer = model_case.build()
    # A realistic "mid-training" state: gradients present, eval flag set on one module.
    TrainingStep(model, optimizer, loss_fn=model_case.loss_fn).loss(
        BatchSource.from_sample(sample).make(2)
    ).backward()
    list(model.modules())[-1].eval()
    before = state_of(model, optimizer)
    live_before = live_tensor_bytes()

    profile = probe(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=model_case.loss_fn,
        device=SimulatedDevice(capacity_bytes=capacity),
    )

    assert profile.max_micro_batch_size == expected
    assert 1 <= profile.recommended_micro_batch_size <= expected
    assert profile.method == "probe"
    assert profile.num_ooms <= 1
    assert_same_state(before, state_of(model, optimizer))
    assert live_tensor_bytes() == live_before


def test_recommended_size_fits_and_keeps_the_margin(
    sim_capacity_for: Callable[[ModelCase, int], int],
) -> None:
    from tests.conftest import MODEL_CASES

    case = MODEL_CASES[0]
    capacity = sim_capacity_for(case, 200)
    model, sample, optimizer = case.build()
    profile = probe(
        model, sample, optimizer=optimizer, loss_fn=case.loss_fn, device=f"sim:{capacity}B"
    )
    assert profile.recommended_micro_batch_size < profile.max_micro_batch_size
    assert profile.memory_model is not None
    assert profile.memory_model.peak_bytes(profile.recommended_micro_batch_size) <= capacity * 0.95
    # and it really runs on the device: one more step at that size does not raise
    device = SimulatedDevice(capacity_bytes=capacity)
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    step.run(source.make(1))
    resident = [*model.parameters(), *[v for s in optimizer.state.values() for v in s.values()]]
    with device.measure(resident) as peak:
        step.run(source.make(profile.recommended_micro_batch_size))
    assert peak.allocated_bytes <= capacity * 0.95


class Toy(torch.nn.Module):
    """10 units of weights; a micro-batch of n samples holds n units (the batch itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(10 * UNIT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean() * self.w.sum()


class Moments(torch.optim.Optimizer):
    """Adam's memory without its temporaries: two in-place moment buffers per parameter."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].add_(p.grad)
                state["v"].addcmul_(p.grad, p.grad)
                p.add_(state["m"], alpha=-group["lr"])


@pytest.mark.parametrize(
    ("make_optimizer", "expected"),
    [
        (lambda params: Moments(params), 60),
        (lambda params: torch.optim.SGD(params, lr=0.1), 80),
    ],
    ids=["two-moment-state", "plain-sgd"],
)
def test_optimizer_state_counts(make_optimizer: Callable[[Any], Any], expected: int) -> None:
    # capacity 100 units (+ half a unit for scalars); weights 10, gradients 10, moments 20,
    # 1 unit per sample: 100 - 40 = 60 with the moments, 100 - 20 = 80 without.
    model = Toy()
    profile = probe(
        model,
        torch.randn(1, UNIT),
        optimizer=make_optimizer(model.parameters()),
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=100 * UNIT * 4 + UNIT * 2),
    )
    assert profile.max_micro_batch_size == expected


def test_a_train_step_that_never_steps_the_optimizer_is_refused() -> None:
    # Its optimizer state would never appear: such a probe would say 80 where training gets 60.
    model = Toy()

    def forward_backward_only(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        loss = m(batch)
        loss.backward()
        for p in m.parameters():
            p.grad = None
        return loss.detach()

    with pytest.raises(ConfigError, match=r"never called step\(\) on the optimizer.*Moments"):
        probe(
            model,
            torch.randn(1, UNIT),
            optimizer=Moments(model.parameters()),
            train_step=forward_backward_only,
            step_includes_update=True,
            device=SimulatedDevice(capacity_bytes=100 * UNIT * 4 + UNIT * 2),
        )


def test_real_adam_temporaries_count_too() -> None:
    # torch's single-tensor Adam builds sqrt(v) and sqrt(v)/c: two more parameter-sized buffers.
    model = Toy()
    profile = probe(
        model,
        torch.randn(1, UNIT),
        optimizer=torch.optim.Adam(model.parameters(), foreach=False),
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=100 * UNIT * 4 + UNIT * 2),
    )
    assert profile.max_micro_batch_size == 40


def test_nothing_fits_names_device_capacity_and_footprint() -> None:
    model = Toy()
    device = SimulatedDevice(capacity_bytes=30 * UNIT * 4, name="sim-small")
    sizes: list[int] = []

    def step(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        sizes.append(batch.shape[0])
        return m(batch)

    with pytest.raises(DoesNotFitError, match=r"sim-small.*capacity 1\.88 MiB.*footprint") as info:
        probe(model, torch.randn(1, UNIT), train_step=step, device=device)
    assert info.value.capacity_bytes == 30 * UNIT * 4
    assert info.value.static_bytes >= 40 * UNIT * 4  # weights + grads + AdamW moments
    assert sizes and min(sizes) == 1


def test_no_tensor_of_a_failed_step_survives_to_the_next_trial() -> None:
    model = Toy()
    refs: list[tuple[int, weakref.ref[torch.Tensor]]] = []
    alive_at_next_trial: list[int] = []
    capacity = 120 * UNIT * 4

    def step(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        alive_at_next_trial.extend(n for n, ref in refs if ref() is not None)
        refs.clear()
        hidden = batch * 2  # an activation the failed step holds when it fails below
        refs.append((batch.shape[0], weakref.ref(hidden)))
        refs.append((batch.shape[0], weakref.ref(batch)))
        wide = hidden.repeat(4, 1)  # the allocation that runs out of memory
        return (wide.mean() * m.w.sum()) / 2

    device = SimulatedDevice(capacity_bytes=capacity)
    # doubling overshoots, so an OOM is followed by more trials
    profile = probe(model, torch.randn(1, UNIT), train_step=step, device=device, use_estimate=False)
    assert any(t.oom for t in profile.trials[:-1])
    assert device.num_ooms == profile.num_ooms
    assert alive_at_next_trial == []


def test_objects_are_frozen_while_the_probe_runs_and_the_collector_left_as_it_was() -> None:
    # The collection after every trial walks only what the probe created (gc.freeze), and the
    # process's own freeze (here conftest's) is neither undone nor added to.
    freeze_counts: list[int] = []

    def run() -> int:
        profile = probe(
            Toy(),
            torch.randn(1, UNIT),
            train_step=lambda m, batch: m(batch),
            device="sim:1GiB",
            max_micro_batch_size=4,
            on_trial=lambda trial: freeze_counts.append(gc.get_freeze_count()),
        )
        return len(profile.trials)

    callers_freeze = gc.get_freeze_count()
    assert callers_freeze > 0  # conftest froze the session's objects
    assert run() == len(freeze_counts) > 0
    # Not frozen again (the objects made since, the model among them, would join); frozen
    # objects the probe frees leave the count.
    assert max(freeze_counts) <= callers_freeze
    assert 0 < gc.get_freeze_count() <= callers_freeze  # the caller's freeze is not undone
    freeze_counts.clear()
    gc.unfreeze()  # a process that froze nothing
    try:
        num_trials = run()
        assert gc.get_freeze_count() == 0
    finally:
        gc.freeze()
    assert num_trials == len(freeze_counts)
    assert min(freeze_counts) > 0


def test_a_non_oom_failure_at_the_first_trial_is_raised_with_context() -> None:
    def broken(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")

    with pytest.raises(StepFailedError, match="other than memory.*shapes cannot") as info:
        probe(Toy(), torch.randn(1, UNIT), train_step=broken, device="sim:1GiB")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.micro_batch_size == 1


def test_a_non_oom_failure_later_is_an_upper_bound_and_the_search_goes_on_below() -> None:
    def launch_limit(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[0] > 10:
            raise RuntimeError("CUDA error: invalid configuration argument")
        return m(batch)

    profile = probe(Toy(), torch.randn(1, UNIT), train_step=launch_limit, device="sim:1GiB")
    failed = [t for t in profile.trials if t.error]
    assert profile.max_micro_batch_size == 10  # the largest size that runs, not the last passed
    assert profile.num_ooms == 0
    assert profile.failed_micro_batch_size == 11
    assert "invalid configuration argument" in profile.stop_reason
    assert all(not t.oom and t.micro_batch_size > 10 for t in failed)
    assert any("11 failed for a reason other than memory" in note for note in profile.notes)
    assert profile.trials[-1].repeat  # the chosen size ran its second step
    assert profile.trials[-1].micro_batch_size == profile.max_micro_batch_size


def test_falls_back_to_doubling_when_the_step_cannot_run_on_fake_tensors() -> None:
    class DataDependent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            if out.sum().item() > 1e9:  # data-dependent control flow: no fake kernel
                out = out * 2
            return out.pow(2).mean()

    model = DataDependent()
    capacity = 4 * 2**20
    profile = probe(model, torch.randn(2, 64), device=SimulatedDevice(capacity_bytes=capacity))
    assert profile.method == "doubling"
    assert any("estimate unavailable" in note for note in profile.notes)
    model.train()
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()))
    source = BatchSource.from_sample(torch.randn(2, 64))
    step.run(source.make(1))
    device = SimulatedDevice(capacity_bytes=capacity)
    opt = step.optimizer

    def fits(n: int) -> bool:
        resident = [*model.parameters(), *[v for s in opt.state.values() for v in s.values()]]
        try:
            with device.measure(resident):
                step.run(source.make(n))
        except torch.OutOfMemoryError:
            return False
        return True

    largest = profile.max_micro_batch_size
    assert fits(largest) and not fits(largest + 1)


def test_callable_sample_and_profile_metadata() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 8), torch.randint(0, 3, (n,))

    profile = probe(model, make, loss_fn=F.cross_entropy, device="sim:2MiB")
    assert profile.input_shape == {"0": (8,), "1": ()}
    assert profile.optimizer == "AdamW"
    assert profile.dtype == "float32"
    assert profile.device_type == "sim" and profile.total_memory_bytes == 2 * 2**20
    assert profile.torch_version == torch.__version__
    assert len(profile.model_fingerprint) == 16
    assert profile.num_trials == len(profile.trials) >= 2


def test_bfloat16_autocast_is_recorded_and_changes_the_answer() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8)
    )
    sample = (torch.randn(2, 256), torch.randint(0, 8, (2,)))
    full = probe(model, sample, loss_fn=F.cross_entropy, device="sim:24MiB")
    mixed = probe(
        model, sample, loss_fn=F.cross_entropy, device="sim:24MiB", amp_dtype=torch.bfloat16
    )
    assert mixed.amp_dtype == "bfloat16" and full.amp_dtype == ""
    assert mixed.max_micro_batch_size != full.max_micro_batch_size


def test_other_tenants_shrink_the_capacity() -> None:
    model = Toy()
    kwargs: dict[str, Any] = {"loss_fn": lambda out: out, "optimizer": None}
    alone = probe(
        model, torch.randn(1, UNIT), device=SimulatedDevice(capacity_bytes=200 * UNIT * 4), **kwargs
    )
    shared = probe(
        model,
        torch.randn(1, UNIT),
        device=SimulatedDevice(capacity_bytes=200 * UNIT * 4, foreign_memory_bytes=50 * UNIT * 4),
        **kwargs,
    )
    assert shared.capacity_bytes == 150 * UNIT * 4
    assert shared.foreign_memory_bytes == 50 * UNIT * 4
    assert alone.max_micro_batch_size - shared.max_micro_batch_size == 50


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        (torch.empty(0, 4), "batch dimension 0"),
        ((torch.randn(3, 4), torch.randn(2)), "disagree on the batch dimension"),
        ({"x": torch.tensor(1.0)}, "0-d scalar"),
        ({"x": "text"}, "holds no tensor"),
    ],
    ids=["empty", "disagree", "scalar", "no-tensor"],
)
def test_bad_samples_get_clear_errors(sample: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        probe(torch.nn.Linear(4, 2), sample, loss_fn=lambda *a: a[0].sum(), device="sim:1GiB")


def test_model_and_sample_on_different_devices() -> None:
    with pytest.raises(ConfigError, match="model is on cpu but the sample is on meta"):
        probe(torch.nn.Linear(4, 2), torch.empty(2, 4, device="meta"), device="sim:1GiB")


def test_a_dict_sample_without_labels_asks_for_loss_fn(model_case: ModelCase) -> None:
    if model_case.name != "gpt2-tiny":
        pytest.skip("one Hugging Face model is enough")
    model, _, _ = model_case.build()
    with pytest.raises(ConfigError, match=r"no \.loss.*labels"):
        probe(model, {"input_ids": torch.randint(0, 256, (2, 8))}, device="sim:1GiB")


def test_a_tuple_sample_without_loss_fn_asks_for_it() -> None:
    with pytest.raises(ConfigError, match="loss_fn"):
        probe(torch.nn.Linear(4, 2), (torch.randn(2, 4), torch.randn(2, 2)), device="sim:1GiB")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"safety_margin": 1.0}, "safety_margin"),
        ({"max_micro_batch_size": 0}, "max_micro_batch_size"),
        ({"device": "tpu:0"}, "not understood"),
        ({"device": "sim:lots"}, "not understood"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        probe(torch.nn.Linear(4, 1), torch.randn(2, 4), loss_fn=lambda o: o.sum(), **kwargs)
