"""autotune end to end: estimate, probe, plan, and the store as a cache."""

from __future__ import annotations

import collections
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import autotune
from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import StepFailedError
from autobatch.probing._batch import BatchSource
from autobatch.probing._step import TrainingStep
from autobatch.profile import Profile
from autobatch.store._store import ProfileStore
from autobatch.tuning import autotune_profile


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


class CountingStep:
    """A train_step that counts its calls (real steps only: fake-tensor traces excluded). The
    count lives in a Counter, not a plain int attribute (a step object's plain attributes are
    part of its cache key), so the same object is looked up under the same key after it ran."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def real_calls(self) -> int:
        return self.counts["real"]

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        inputs, targets = batch
        if not isinstance(inputs, FakeTensor):
            self.counts["real"] += 1
        return F.cross_entropy(model(inputs), targets)


def test_second_call_comes_from_the_store_without_a_step(tmp_path: Path) -> None:
    model = mlp()
    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    step = CountingStep()
    kwargs: dict[str, Any] = {
        "effective_batch_size": 1000,
        "train_step": step,
        "device": "sim:6MiB",
        "store": tmp_path / "profiles.sqlite3",
    }
    first = autotune(model, sample, **kwargs)
    steps_first = step.real_calls
    assert first.source == "measured" and steps_first >= 2
    second = autotune(model, sample, **kwargs)
    assert step.real_calls == steps_first  # no step ran
    assert second.source == "cached"
    assert second.micro_batch_size == first.micro_batch_size
    assert second.gradient_accumulation_steps == first.gradient_accumulation_steps
    third = autotune(model, sample, refresh=True, **kwargs)
    assert step.real_calls > steps_first
    assert third.source == "measured"
    with ProfileStore(tmp_path / "profiles.sqlite3") as store:
        assert len(store.list_profiles()) == 2


def test_a_different_input_shape_is_not_served_from_the_cache(tmp_path: Path) -> None:
    model = mlp()
    store = tmp_path / "s.sqlite3"
    short = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    plan = autotune(
        model,
        short,
        effective_batch_size=64,
        loss_fn=F.cross_entropy,
        device="sim:6MiB",
        store=store,
    )
    assert plan.source == "measured"
    model2 = torch.nn.Sequential(
        torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    other = (torch.randn(2, 32), torch.randint(0, 10, (2,)))
    plan2 = autotune(
        model2,
        other,
        effective_batch_size=64,
        loss_fn=F.cross_entropy,
        device="sim:6MiB",
        store=store,
    )
    assert plan2.source == "measured"


def test_the_plan_trains_20_steps_right_after_without_oom(tmp_path: Path) -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    capacity = 6 * 2**20
    plan = autotune(
        model,
        sample,
        effective_batch_size=1024,
        optimizer=optimizer,
        loss_fn=F.cross_entropy,
        device=SimulatedDevice(capacity_bytes=capacity),
        use_store=False,
    )
    assert plan.effective_batch_size == 1024
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 1024
    device = SimulatedDevice(capacity_bytes=capacity)
    source = BatchSource.from_sample(sample)
    step = TrainingStep(model, optimizer, loss_fn=F.cross_entropy)
    for _ in range(20):
        resident = [
            *model.parameters(),
            *[v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)],
        ]
        with device.measure(resident):
            step.run(source.make(plan.micro_batch_size))
    assert device.num_ooms == 0


def test_an_impossible_request_is_refused_before_probing() -> None:
    from autobatch.errors import ConfigError

    step = CountingStep()
    with pytest.raises(ConfigError, match="not a multiple of world_size 3"):
        autotune(
            mlp(),
            (torch.randn(2, 64), torch.randint(0, 10, (2,))),
            effective_batch_size=100,
            world_size=3,
            train_step=step,
            device="sim:6MiB",
            use_store=False,
        )
    assert step.real_calls == 0


def test_a_service_that_cannot_take_the_report_warns_and_the_plan_is_returned(
    tmp_path: Path,
) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.warns(
        autobatch.errors.ReportWarning, match="could not register the profile"
    ) as caught:
        plan = autotune(
            mlp(),
            (torch.randn(2, 64), torch.randint(0, 10, (2,))),
            effective_batch_size=64,
            loss_fn=F.cross_entropy,
            device="sim:6MiB",
            store=tmp_path / "s.sqlite3",
            report_to=url,
        )
    assert plan.source == "measured" and plan.effective_batch_size == 64
    assert f"could not connect to {url}: " in str(caught[0].message)
    assert "Errno" not in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's autotune line


def test_use_store_false_neither_reads_nor_writes_a_given_store(tmp_path: Path) -> None:
    model = mlp()
    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    step = CountingStep()
    with ProfileStore(tmp_path / "s.sqlite3") as store:
        kwargs: dict[str, Any] = {
            "effective_batch_size": 64,
            "train_step": step,
            "device": "sim:6MiB",
            "store": store,
        }
        assert autotune(model, sample, **kwargs).source == "measured"
        (stored,) = store.list_profiles()
        steps_before = step.real_calls
        again = autotune(model, sample, use_store=False, **kwargs)
        assert again.source == "measured"  # the stored profile would have answered: not read
        assert step.real_calls > steps_before
        assert store.list_profiles() == [stored]  # nothing written


def test_tune_returns_the_plan_the_profile_and_its_stored_id(tmp_path: Path) -> None:
    model = mlp()
    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    kwargs: dict[str, Any] = {
        "effective_batch_size": 96,
        "loss_fn": F.cross_entropy,
        "device": "sim:6MiB",
        "store": tmp_path / "s.sqlite3",
    }
    first = autobatch.tuning.tune(model, sample, **kwargs)
    assert first.plan.source == "measured"
    assert first.plan.micro_batch_size <= first.profile.recommended_micro_batch_size
    second = autobatch.tuning.tune(model, sample, **kwargs)
    assert second.plan.source == "cached"
    assert second.profile_id == first.profile_id is not None
    with ProfileStore(tmp_path / "s.sqlite3") as store:
        assert store.get(first.profile_id) == first.profile == second.profile
    unstored = autobatch.tuning.tune(model, sample, use_store=False, **kwargs)
    assert unstored.profile_id is None


class ArmedStep:
    """A train_step that, once armed, fails at its first real step: a request the store does
    not answer shows up as StepFailedError, without running a whole probe. The switch is an
    Event, not a plain flag, so arming it leaves the step's cache key (its plain settings) alone."""

    def __init__(self) -> None:
        self.armed = threading.Event()

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        inputs, targets = batch
        if self.armed.is_set() and not isinstance(inputs, FakeTensor):
            raise RuntimeError("probed: the store did not answer")
        return F.cross_entropy(model(inputs), targets)


@pytest.fixture(scope="module")
def probed() -> tuple[torch.nn.Module, Any, ArmedStep, Profile]:
    """One real probe (a boundary found below the limit), to vary in each store below."""
    model, step = mlp(), ArmedStep()
    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    found = autotune_profile(model, sample, train_step=step, device="sim:6MiB", use_store=False)
    assert found.profile.stop_kind == "boundary"
    assert found.profile.max_micro_batch_size < 1000
    step.armed.set()
    return model, sample, step, found.profile


@pytest.mark.parametrize(
    ("stored_change", "request_change", "answers"),
    [
        ({}, {}, True),
        ({}, {"max_micro_batch_size": 5000}, True),  # a boundary holds under a larger limit
        ({"safety_margin": 0.1}, {}, False),
        ({"capacity_bytes": "-0.5%"}, {}, True),  # within the tolerance
        ({"capacity_bytes": "-2%"}, {}, False),  # memory was freed since: it could be larger
        ({}, {"foreign_memory_bytes": 2 * 6 * 2**20 // 100}, False),  # another process took 2%
        ({}, {"max_micro_batch_size": "max-1"}, False),  # the profile exceeds the new limit
        ({"stop_kind": "limit"}, {"max_micro_batch_size": "max"}, True),
        ({"stop_kind": "limit"}, {"max_micro_batch_size": 5000}, False),  # might go further
        ({"stop_kind": "failure", "failed_micro_batch_size": "max+1"}, {}, False),
    ],
)
def test_every_cache_reuse_rule(
    tmp_path: Path,
    probed: tuple[torch.nn.Module, Any, ArmedStep, Profile],
    stored_change: dict[str, Any],
    request_change: dict[str, Any],
    answers: bool,
) -> None:
    model, sample, step, profile = probed
    largest = profile.max_micro_batch_size
    sizes = {"max": largest, "max-1": largest - 1, "max+1": largest + 1}
    change = {k: sizes.get(v, v) for k, v in stored_change.items()}
    if isinstance(change.get("capacity_bytes"), str):
        change["capacity_bytes"] = int(
            profile.capacity_bytes * (1 + float(change["capacity_bytes"].rstrip("%")) / 100)
        )
    request: dict[str, Any] = {"max_micro_batch_size": 1 << 16, "safety_margin": 0.05}
    request.update({k: sizes.get(v, v) for k, v in request_change.items()})
    device = SimulatedDevice(  # the same card (name, total): the same cache key
        capacity_bytes=6 * 2**20, foreign_memory_bytes=request.pop("foreign_memory_bytes", 0)
    )
    with ProfileStore(tmp_path / "s.sqlite3") as store:
        stored_id = store.put(dataclasses.replace(profile, **change))
        if answers:
            found = autotune_profile(
                model, sample, train_step=step, device=device, store=store, **request
            )
            assert found.cached and found.profile_id == stored_id
        else:
            with pytest.raises(StepFailedError, match="probed: the store did not answer"):
                autotune_profile(
                    model, sample, train_step=step, device=device, store=store, **request
                )


class TinyClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layer(inputs)


def test_a_profile_names_its_model_by_class_or_as_told(tmp_path: Path) -> None:
    # The name is for listings (profiles list, GET /v1/profiles); it never changes what a
    # stored profile answers for: the same step under another name is read from the store.
    from autobatch.probing._options import model_class_name

    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    kwargs: dict[str, Any] = {
        "loss_fn": F.cross_entropy,
        "device": "sim:6MiB",
        "store": tmp_path / "profiles.sqlite3",
    }
    model = TinyClassifier()
    measured = autotune_profile(model, sample, **kwargs)
    assert measured.profile.model_name == "TinyClassifier"
    again = autotune_profile(model, sample, model_name="my-classifier", **kwargs)
    assert again.cached and again.profile.model_name == "TinyClassifier"
    told = autotune_profile(model, sample, model_name="my-classifier", refresh=True, **kwargs)
    assert told.profile.model_name == "my-classifier"
    # Through the wrappers a user's model comes in.
    assert model_class_name(torch.nn.DataParallel(model)) == "TinyClassifier"
    assert model_class_name(mlp()) == "Sequential"
