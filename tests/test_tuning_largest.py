"""``autotune`` without ``effective_batch_size`` answers the largest micro-batch (Lightning's
``BatchSizeFinder`` question): one micro-batch per optimizer step at the profile's recommended
size, on every data-parallel rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autobatch

DEVICE = "sim:8MiB"


def model_and_sample() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return model, (torch.randn(1, 32), torch.randint(0, 10, (1,)))


def test_the_largest_micro_batch_is_the_probes_recommended_one_per_step() -> None:
    model, sample = model_and_sample()
    probed = autobatch.probe(model, sample, loss_fn=F.cross_entropy, device=DEVICE)
    plan = autobatch.autotune(
        model, sample, loss_fn=F.cross_entropy, device=DEVICE, use_store=False
    )
    largest = probed.recommended_micro_batch_size
    assert largest < probed.max_micro_batch_size  # the margin: recommended, not the max
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (largest, 1)
    assert (plan.effective_batch_size, plan.max_micro_batch_size) == (largest, largest)
    assert plan.source == "measured"


def test_on_ranks_and_in_multiples_the_largest_is_per_rank_and_rounded_down() -> None:
    model, sample = model_and_sample()
    probed = autobatch.probe(model, sample, loss_fn=F.cross_entropy, device=DEVICE)
    plan = autobatch.autotune(
        model,
        sample,
        loss_fn=F.cross_entropy,
        device=DEVICE,
        use_store=False,
        world_size=2,
        multiple_of=64,
    )
    largest = probed.recommended_micro_batch_size // 64 * 64
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (largest, 1)
    assert plan.effective_batch_size == 2 * largest and plan.world_size == 2
