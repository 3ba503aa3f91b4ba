"""Confirm on arrival: a plan predicted for this card is tried once before it is used."""

from __future__ import annotations

import collections
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autobatch import SimulatedDevice, autotune, plan
from autobatch.client import ServiceProfiles
from autobatch.probing._options import ProbeOptions, StepSpec
from autobatch.profile import Profile, StepIdentity
from autobatch.store._store import ProfileStore
from autobatch.tuning import autotune_profile, find_profile
from autobatch.tuning._cache import StoreOptions
from autobatch.tuning._confirmation import find_prediction, stored_profiles
from tests.store.test_remote import Shelf


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


class CountingStep:
    """A train_step that counts its real calls (fake-tensor traces excluded). The count lives in
    a Counter, not a plain int attribute, so counting leaves the step's cache key (its class code
    and plain settings) unchanged."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def real_calls(self) -> int:
        return self.counts["real"]

    @real_calls.setter
    def real_calls(self, value: int) -> None:
        self.counts["real"] = value

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        inputs, targets = batch
        if not isinstance(inputs, FakeTensor):
            self.counts["real"] += 1
        return F.cross_entropy(model(inputs), targets)


SAMPLE = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
STEP = CountingStep()
"""One instance throughout, its calls counted across the probe and the confirmation."""


@pytest.fixture(scope="module")
def probed_on_a_small_card(tmp_path_factory: pytest.TempPathFactory) -> Profile:
    """A real probe on a 6 MiB card (one per module: the estimate is the slow part)."""
    store = tmp_path_factory.mktemp("small") / "profiles.sqlite3"
    found = autotune_profile(
        mlp(), SAMPLE, train_step=STEP, device=SimulatedDevice(capacity_bytes=6 << 20), store=store
    )
    assert not found.cached
    return found.profile


def small_card_profile(store: Path, profile: Profile) -> Profile:
    """Store the small card's profile in a fresh store."""
    with ProfileStore(store) as opened:
        opened.put(profile)
    return profile


@pytest.mark.slow  # a real probe (shared), then the confirmation
def test_a_predicted_plan_is_confirmed_by_one_real_trial_then_reads_as_measured(
    tmp_path: Path, probed_on_a_small_card: Profile
) -> None:
    store = tmp_path / "profiles.sqlite3"
    step = STEP
    small = small_card_profile(store, probed_on_a_small_card)
    large_capacity = 24 * 2**20
    predicted = plan(
        small, effective_batch_size=1, capacity_bytes=int(large_capacity), source="cached"
    )
    assert predicted.source == "predicted"  # what a scheduler was told for the 24 MiB card

    step.real_calls = 0
    kwargs: dict[str, Any] = {"train_step": step, "device": "sim:24MiB", "store": store}
    arrived = autotune(mlp(), SAMPLE, effective_batch_size=4096, **kwargs)

    # The warm-up step that creates AdamW's state, then one trial at the predicted size, which
    # runs a second consecutive step as every chosen size does.
    assert step.real_calls == 3
    assert arrived.source == "measured"
    assert arrived.max_micro_batch_size == predicted.max_micro_batch_size
    with ProfileStore(store) as opened:
        confirmed = opened.list_profiles()[0][1]
    assert confirmed.stop_reason.startswith("confirmation: micro-batch")
    assert confirmed.max_micro_batch_size == predicted.max_micro_batch_size
    confirmed_size = predicted.max_micro_batch_size
    assert [(t.micro_batch_size, t.repeat) for t in confirmed.trials] == [
        (1, False),
        (confirmed_size, False),
        (confirmed_size, True),
    ]
    assert any("confirmed by one real trial" in note for note in confirmed.notes)
    again = autotune(mlp(), SAMPLE, effective_batch_size=4096, **kwargs)
    assert step.real_calls == 3  # from the store now
    assert again.source == "cached"


@pytest.mark.slow  # the failed trial, then a full probe
def test_a_failed_confirmation_probes_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, probed_on_a_small_card: Profile
) -> None:
    store = tmp_path / "profiles.sqlite3"
    step = STEP
    small = small_card_profile(store, probed_on_a_small_card)
    # A profile of the same step whose memory line says a quarter of the true bytes per sample:
    # it predicts far too large a micro-batch for the 24 MiB card.
    assert small.memory_model is not None
    wrong = dataclasses.replace(
        small,
        memory_model=dataclasses.replace(
            small.memory_model, bytes_per_sample=small.memory_model.bytes_per_sample // 4
        ),
    )
    with ProfileStore(store) as opened:
        opened.put(wrong)
        found = find_prediction(
            stored_profiles(opened, small.identity),
            small.identity,
            device_name="sim",
            total_memory_bytes=24 * 2**20,
            capacity_bytes=24 * 2**20,
            safety_margin=0.05,
            search_limit=4096,
        )
    assert found is not None and found.profile == wrong

    step.real_calls = 0
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        found_here = autotune_profile(
            mlp(),
            SAMPLE,
            train_step=step,
            device=SimulatedDevice(capacity_bytes=24 << 20),
            store=store,
        )
    profile, cached = found_here.profile, found_here.cached

    assert not cached
    assert step.real_calls > 2  # the failed trial, then a normal probe
    assert profile.trials[-1].micro_batch_size != found.micro_batch_size
    assert profile.max_micro_batch_size < found.micro_batch_size
    assert not profile.stop_reason.startswith("confirmation")
    assert any("the confirming trial failed" in note for note in profile.notes)
    assert "the confirming trial failed" in caplog.text
    result = plan(profile, effective_batch_size=64)
    assert result.source == "measured"


def test_no_prediction_without_a_profile_of_the_same_step(
    tmp_path: Path, probed_on_a_small_card: Profile
) -> None:
    store = tmp_path / "profiles.sqlite3"
    small = small_card_profile(store, probed_on_a_small_card)
    with ProfileStore(store) as opened:
        other_step = dataclasses.replace(
            small.identity, input_shape={**small.identity.input_shape, "extra": (1,)}
        )
        assert (
            find_prediction(
                stored_profiles(opened, other_step),
                other_step,
                device_name="sim",
                total_memory_bytes=24 * 2**20,
                capacity_bytes=24 * 2**20,
                safety_margin=0.05,
                search_limit=4096,
            )
            is None
        )
        # The same card: the store's own cache answers; nothing is predicted.
        assert (
            find_prediction(
                stored_profiles(opened, small.identity),
                small.identity,
                device_name=small.device_name,
                total_memory_bytes=small.total_memory_bytes,
                capacity_bytes=small.capacity_bytes,
                safety_margin=0.05,
                search_limit=4096,
            )
            is None
        )


def test_an_evaluation_micro_batch_is_never_predicted_from_a_training_profile(
    tmp_path: Path, probed_on_a_small_card: Profile
) -> None:
    # The training profile (same step identity) predicts a training size for the larger card;
    # an evaluation (a forward only) fits far more, so "confirming" that size for eval would
    # store the training size as the eval micro-batch. Eval finds no prediction and probes.
    store = tmp_path / "profiles.sqlite3"
    small = small_card_profile(store, probed_on_a_small_card)
    assert small.mode == "train"
    options: dict[str, Any] = {
        "device_name": "sim",
        "total_memory_bytes": 24 * 2**20,
        "capacity_bytes": 24 * 2**20,
        "safety_margin": 0.05,
        "search_limit": 4096,
    }
    with ProfileStore(store) as opened:
        candidates = stored_profiles(opened, small.identity)
    assert find_prediction(candidates, small.identity, **options) is not None  # training
    assert find_prediction(candidates, small.identity, mode="eval", **options) is None
    evaluation = dataclasses.replace(small, mode="eval")
    assert find_prediction([("e", evaluation)], small.identity, **options) is None


def test_a_profile_measured_under_other_conditions_predicts_nothing(
    tmp_path: Path, probed_on_a_small_card: Profile
) -> None:
    store = tmp_path / "profiles.sqlite3"
    small = small_card_profile(store, probed_on_a_small_card)
    options: dict[str, Any] = {
        "device_name": "sim",
        "total_memory_bytes": 24 * 2**20,
        "capacity_bytes": 24 * 2**20,
        "safety_margin": 0.05,
        "search_limit": 4096,
    }
    with ProfileStore(store) as opened:
        candidates = stored_profiles(opened, small.identity)
    assert small.conditions.optimizer == "torch.optim.adamw.AdamW"
    same = small.conditions
    assert find_prediction(candidates, small.identity, conditions=same, **options) is not None
    other = dataclasses.replace(same, optimizer="bitsandbytes.optim.adamw.AdamW8bit")
    assert find_prediction(candidates, small.identity, conditions=other, **options) is None


def test_an_unreachable_service_gives_no_profiles_and_says_why() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    identity = StepIdentity(model_fingerprint="fp")
    found, why = ServiceProfiles(url).profiles_of(identity)
    assert found == []
    assert why.startswith(f"could not ask the autobatch service at {url}")


@pytest.mark.slow  # a real probe (shared), then the confirmation
def test_a_prediction_from_the_remote_the_road_is_given_is_confirmed_and_reported_to_it(
    tmp_path: Path, probed_on_a_small_card: Profile
) -> None:
    # The local store is empty; only the remote holds the small card's profile. The road asks
    # the remote it was given (no URL, no HTTP), confirms its prediction with one real trial,
    # stores the confirming profile here and hands it to the same remote.
    small = probed_on_a_small_card
    predicted = plan(small, effective_batch_size=1, capacity_bytes=24 * 2**20, source="cached")
    assert predicted.source == "predicted"
    shelf = Shelf([small])
    step = StepSpec.build(mlp(), SAMPLE, train_step=STEP)
    options = ProbeOptions.build(step, device=SimulatedDevice(capacity_bytes=24 << 20))
    storing = StoreOptions(store=tmp_path / "local.sqlite3", remote=shelf)

    found = find_profile(step, options, storing)

    assert shelf.asked == [step.identity]
    assert not found.cached
    assert found.profile.stop_reason.startswith("confirmation: micro-batch")
    assert found.profile.max_micro_batch_size == predicted.max_micro_batch_size
    assert any("from profile shelf 0" in note for note in found.profile.notes)
    assert shelf.reported == [found.profile]
    with ProfileStore(tmp_path / "local.sqlite3") as opened:
        assert [profile for _, profile in opened.list_profiles()] == [found.profile]
