"""Steps that differ from one call to the next: a train_step that steps the optimizer only every
few calls (its own accumulation), and a second step at a size that needs more than the first."""

from __future__ import annotations

import pytest
import torch

from autobatch import probe
from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError
from autobatch.probing._trials import MAX_WARM_UP_CALLS
from tests.probing.test_probe import UNIT, Moments, Toy, assert_same_state, state_of

CAPACITY_BYTES = 100 * UNIT * 4 + UNIT * 2
"""100 units (+ half a unit for scalars): weights 10, gradients 10, moments 20, 1 unit per
sample, so 60 samples fit once the optimizer state exists, 80 without it."""


class Accumulating:
    """A train_step that updates by itself, stepping the optimizer every ``every`` calls."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, every: int) -> None:
        self.optimizer = optimizer
        self.every = every
        self.calls = 0

    def __call__(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = model(batch)
        loss.backward()
        if self.calls % self.every == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def test_a_step_that_updates_every_few_calls_is_probed_with_the_optimizer_state() -> None:
    # The field report: the trials never stepped the optimizer, so its state never appeared and
    # the probe said 80 where training runs out of memory at its first update.
    model = Toy()
    optimizer = Moments(model.parameters())
    step = Accumulating(optimizer, every=8)
    sample = torch.randn(1, UNIT)
    before = state_of(model, optimizer)
    profile = probe(
        model,
        sample,
        optimizer=optimizer,
        train_step=step,
        step_includes_update=True,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
    )
    assert profile.max_micro_batch_size == 60
    warm_up = profile.trials[0]
    assert warm_up.warm_up and warm_up.micro_batch_size == 1 and not warm_up.skipped_optimizer_step
    # The warm-up called it 8 times; the chosen size's trial skipped the update, so its second
    # step ran it until the optimizer stepped (at a multiple of 8 calls again).
    assert profile.num_steps > 8 + len(profile.trials) - 1
    assert step.calls % 8 == 0
    assert not profile.trials[-1].skipped_optimizer_step and profile.trials[-1].repeat
    skipped = [t.micro_batch_size for t in profile.trials if t.skipped_optimizer_step]
    assert skipped and all(not t.oom for t in profile.trials if t.skipped_optimizer_step)
    (note,) = [n for n in profile.notes if "did not step the optimizer" in n]
    assert f"micro-batch {', '.join(map(str, sorted(set(skipped))))} " in note
    assert not optimizer._optimizer_step_post_hooks  # the counting hook was removed
    assert_same_state(before, state_of(model, optimizer))


def test_a_step_that_updates_less_often_than_the_warm_up_allows_is_refused() -> None:
    model = Toy()
    optimizer = Moments(model.parameters())
    step = Accumulating(optimizer, every=MAX_WARM_UP_CALLS + 1)
    with pytest.raises(ConfigError, match=rf"ran {MAX_WARM_UP_CALLS} times at micro-batch 1"):
        probe(
            model,
            torch.randn(1, UNIT),
            optimizer=optimizer,
            train_step=step,
            step_includes_update=True,
            device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        )
    assert step.calls == MAX_WARM_UP_CALLS
    assert not optimizer._optimizer_step_post_hooks
    assert not optimizer.state


def test_a_train_step_stepping_another_optimizer_is_refused() -> None:
    model = Toy()
    passed, stepped = Moments(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="pass the optimizer it steps"):
        probe(
            model,
            torch.randn(1, UNIT),
            optimizer=passed,
            train_step=Accumulating(stepped, every=1),
            step_includes_update=True,
            device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        )


class SecondStepGrows(Toy):
    """Toy whose forward holds a 12-unit workspace from the second step at a size on (as an
    allocator that grows after its first step might): 60 fits once, only 58 fits twice."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[0]
        workspace = torch.ones(12 * UNIT) if size in self.seen else torch.ones(1)
        self.seen.add(size)
        return x.mean() * self.w.sum() * workspace[0]


def test_the_chosen_size_must_fit_at_its_second_step_too() -> None:
    model = SecondStepGrows()
    profile = probe(
        model,
        torch.randn(1, UNIT),
        optimizer=Moments(model.parameters()),
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        use_estimate=False,  # a fake step would run the forward too, and mark sizes as seen
    )
    assert profile.max_micro_batch_size == 58
    repeats = [(t.micro_batch_size, t.fits) for t in profile.trials if t.repeat]
    assert repeats[0][1] is False and repeats[0][0] > 58
    assert repeats[-1] == (58, True) and profile.trials[-1].repeat
    assert any("fitted at its first step but not at its second" in n for n in profile.notes)


def test_a_well_behaved_step_costs_one_more_step_with_the_same_peak() -> None:
    model = Toy()
    profile = probe(
        model,
        torch.randn(1, UNIT),
        optimizer=Moments(model.parameters()),
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
    )
    assert profile.max_micro_batch_size == 60
    *search, repeat = profile.trials
    assert repeat.repeat and not any(t.repeat for t in search)
    assert repeat.micro_batch_size == 60 and repeat.fits
    assert profile.num_steps == len(search) + 1
    (first,) = [t for t in search if t.micro_batch_size == 60]
    assert repeat.peak_allocated_bytes == first.peak_allocated_bytes


def test_an_optimizer_with_state_and_no_estimate_still_searches() -> None:
    # Mid-training (state present, so no warm-up) and no estimate (use_estimate=False, or a
    # train_step that updates by itself): no first size was chosen, and the probe said
    # "does not fit even at micro-batch 1" without running a step.
    model = Toy()
    optimizer = Moments(model.parameters())
    optimizer.zero_grad()
    model(torch.randn(1, UNIT)).backward()
    optimizer.step()
    profile = probe(
        model,
        torch.randn(1, UNIT),
        optimizer=optimizer,
        loss_fn=lambda out: out,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        use_estimate=False,
    )
    assert profile.max_micro_batch_size == 60
    assert profile.trials[0].micro_batch_size == 1 and not profile.trials[0].warm_up


@pytest.mark.parametrize("every", [2, 3, 5])
def test_the_chosen_size_ran_a_measured_step_with_an_update(every: int) -> None:
    # A step that updates every few calls may skip the update at the chosen size's trial and at
    # its second step: its peak then lacks the update's temporaries. The chosen size is run
    # again (bounded, as the warm-up is) until one of its measured steps updates.
    model = Toy()
    optimizer = Moments(model.parameters())
    step = Accumulating(optimizer, every=every)
    sample = torch.randn(1, UNIT)
    before = state_of(model, optimizer)
    profile = probe(
        model,
        sample,
        optimizer=optimizer,
        train_step=step,
        step_includes_update=True,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        use_estimate=False,
    )
    chosen = profile.max_micro_batch_size
    assert chosen == 60
    measured = [t for t in profile.trials if t.micro_batch_size == chosen and not t.warm_up]
    assert all(t.fits for t in measured)
    assert any(not t.skipped_optimizer_step for t in measured)
    assert measured[-1].repeat
    assert_same_state(before, state_of(model, optimizer))
