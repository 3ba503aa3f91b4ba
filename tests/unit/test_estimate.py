"""The estimator: fake tensors, no memory, close to what the simulated device measures."""

from __future__ import annotations

import resource

import pytest
import torch

from autobatch.batch import BatchSource
from autobatch.device.simulated import SimulatedDevice
from autobatch.errors import DoesNotFitError
from autobatch.estimator import FakeStep, estimate
from autobatch.state import resident_tensors
from autobatch.step import TrainingStep
from tests.conftest import ModelCase


def measured_peak(case: ModelCase, size: int) -> int:
    """Peak live bytes of one real step (optimizer state present) on the simulated device."""
    model, sample, optimizer = case.build()
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    step.run(source.make(1))
    resident = resident_tensors(model, optimizer)
    with SimulatedDevice(capacity_bytes=1 << 40).measure(resident) as peak:
        step.run(source.make(size))
    return peak.allocated_bytes


@pytest.mark.parametrize("size", [1, 7, 32])
def test_estimated_peak_within_10_percent_of_measured(model_case: ModelCase, size: int) -> None:
    model, sample, optimizer = model_case.build()
    fake = FakeStep(model, optimizer, BatchSource.from_sample(sample), loss_fn=model_case.loss_fn)
    estimated = fake.peak_bytes(size)
    measured = measured_peak(model_case, size)
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


def test_gpt2_small_at_100_gib_sizes_in_seconds_without_allocating() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    ids = torch.randint(0, 50257, (1, 512))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fake = FakeStep(model, None, BatchSource.from_sample({"input_ids": ids, "labels": ids}))
    peak = fake.peak_bytes(64)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak > 64 * 2**30  # 64 x 512 tokens of GPT-2 with AdamW: ~80 GiB
    assert rss_after - rss_before < 2 * 2**30  # nothing close to that was allocated


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
