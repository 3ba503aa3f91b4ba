"""The estimator: fake tensors, no memory, close to what the CPU allocator really gives a step."""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from autobatch.errors import DoesNotFitError
from autobatch.probing._batch import BatchSource
from autobatch.probing._estimator import FakeStep, estimate
from autobatch.probing._snapshot import resident_tensors
from autobatch.probing._step import TrainingStep
from tests.conftest import ModelCase


def allocator_peak(case: ModelCase, size: int) -> int:
    """Peak bytes of one real CPU step (optimizer state present), from torch's CPU allocator as
    its profiler records it: a reference independent of the estimator's live-byte counter (which
    the simulated device shares, so comparing with it could not fail)."""
    model, sample, optimizer = case.build()
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    step.run(source.make(1))
    resident = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in resident_tensors(model, optimizer)
    }
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step.run(source.make(size))
    events = [e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # allocations positive, frees negative
        peak = max(peak, live)
    return sum(resident.values()) + peak


# At micro-batch 1 the CPU's convolution takes a workspace the fake step does not see (the CNN
# case: estimated 141 KB, allocator 251 KB); the probe's real trials cover such workspaces.
@pytest.mark.parametrize("size", [7, 32])
def test_estimated_peak_within_10_percent_of_the_allocators(
    model_case: ModelCase, size: int
) -> None:
    model, sample, optimizer = model_case.build()
    fake = FakeStep(model, optimizer, BatchSource.from_sample(sample), loss_fn=model_case.loss_fn)
    estimated = fake.peak_bytes(size)
    measured = allocator_peak(model_case, size)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_estimate_leaves_model_and_optimizer_untouched(model_case: ModelCase) -> None:
    model, sample, optimizer = model_case.build()
    before = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    profile = estimate(
        model, sample, optimizer=optimizer, loss_fn=model_case.loss_fn, capacity_bytes=64 * 2**20
    )
    assert profile.method == "estimate" and profile.max_micro_batch_size >= 1
    after = [*model.parameters(), *model.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise LookupError(field)


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS"
)
def test_gpt2_small_at_100_gib_sizes_in_seconds_without_allocating() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):  # no random init of 124M weights: values do not count
        model = GPT2LMHeadModel(GPT2Config())
    model = model.to_empty(device="cpu")
    model.tie_weights()  # lm_head shares the embedding again, as in a model built on the CPU
    ids = torch.randint(0, 50257, (1, 512))
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the process's peak resident size (VmHWM) restarts from now
    rss_before = _status_kib("VmRSS")
    fake = FakeStep(model, None, BatchSource.from_sample({"input_ids": ids, "labels": ids}))
    peak = fake.peak_bytes(64)
    peak_growth_bytes = (_status_kib("VmHWM") - rss_before) * 1024
    assert peak > 64 * 2**30  # 64 x 512 tokens of GPT-2 with AdamW: ~80 GiB
    assert peak_growth_bytes < 2 * 2**30  # the process never held anything close to that


def test_estimate_says_when_nothing_fits() -> None:
    model = torch.nn.Linear(1024, 1024)
    with pytest.raises(DoesNotFitError, match="needs about .* at micro-batch 1"):
        estimate(model, torch.randn(1, 1024), loss_fn=lambda o: o.sum(), capacity_bytes=2**20)


@pytest.mark.parametrize("capacity", [0, -1, True, "1GiB", 1.5])
def test_capacity_must_be_a_positive_int_of_bytes(capacity: object) -> None:
    from autobatch.errors import ConfigError

    with pytest.raises(ConfigError, match="capacity_bytes .* must be a positive int of bytes"):
        estimate(
            torch.nn.Linear(2, 2),
            torch.randn(1, 2),
            loss_fn=lambda o: o.sum(),
            capacity_bytes=capacity,
        )  # type: ignore[arg-type]


def test_the_estimates_line_is_what_its_trials_support() -> None:
    # Two 256-wide layers and SGD: the fixed bytes hold the weights (2 x 256 x 256 x 4 bytes =
    # 512 KiB) and at most their gradients besides, never less than nothing (a secant through
    # adjacent sizes said -144.64 MiB for gpt2-tiny), and the line meets every fitting trial
    # from 2 up (an exactly linear peak) within 1%.
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256, bias=False),
    )
    profile = estimate(
        model,
        torch.randn(1, 256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda out: out.sum(),
        capacity_bytes=64 * 2**20,
    )
    line = profile.memory_model
    weights = 2 * 256 * 256 * 4
    assert line is not None and weights <= line.fixed_bytes <= 2 * weights
    fitted = [t for t in profile.trials if t.fits and t.micro_batch_size >= 2]
    assert len(fitted) >= 2
    for trial in fitted:
        predicted = line.peak_bytes(trial.micro_batch_size)
        assert abs(predicted - trial.peak_allocated_bytes) <= trial.peak_allocated_bytes // 100
    # Per sample: the input, two activations kept for backward and their gradients, 256 floats
    # each, is what the trials' slope says, within one allocation.
    assert 3 * 256 * 4 <= line.bytes_per_sample <= 8 * 256 * 4
