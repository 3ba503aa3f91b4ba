"""autotune_accelerator with a real Accelerator on the CPU and a simulated card: it sets the
Accelerator's gradient accumulation steps, and a loop over a dataloader rebuilt at the planned
micro-batch steps the optimizer once per effective batch."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.errors import ConfigError  # noqa: E402
from autobatch.integrations.accelerate import autotune_accelerator  # noqa: E402

MIB = 2**20
CAPACITY_BYTES = MIB * 3 // 10  # an MLP 32-256-10 with AdamW fits about 50 samples here


@pytest.fixture
def accelerator() -> Iterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield accelerate.Accelerator(cpu=True)
    # The Accelerator's state is process-wide; leave none to the next test.
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def mlp_setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = torch.utils.data.TensorDataset(torch.randn(384, 32), torch.randint(0, 10, (384,)))
    return model, optimizer, dataset


def test_sets_accumulation_and_a_rebuilt_loop_steps_once_per_effective_batch(
    accelerator: Any,
) -> None:
    model, optimizer, dataset = mlp_setup()
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.random.get_rng_state()

    plan = autotune_accelerator(
        accelerator,
        model,
        loader,
        96,
        optimizer=optimizer,
        loss_fn=F.cross_entropy,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        use_store=False,
    )
    assert 1 < plan.max_micro_batch_size < 96 and plan.gradient_accumulation_steps > 1
    assert accelerator.gradient_accumulation_steps == plan.gradient_accumulation_steps
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 96
    # Nothing of the model, optimizer or RNG moved.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.state_dict()["state"]
    assert torch.equal(torch.random.get_rng_state(), rng)

    loader = accelerator.prepare(
        torch.utils.data.DataLoader(dataset, batch_size=plan.micro_batch_size, shuffle=True)
    )
    sizes, num_updates = [], 0
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            sizes.append(inputs.shape[0])
            accelerator.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()
            num_updates += int(accelerator.sync_gradients)
            optimizer.zero_grad()
    assert sizes == [plan.micro_batch_size] * (384 // plan.micro_batch_size)
    assert num_updates == 384 // 96  # one optimizer step per effective batch


def test_options_it_sets_itself_are_refused(accelerator: Any) -> None:
    model, optimizer, dataset = mlp_setup()
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    with pytest.raises(ConfigError, match="sets 'world_size' itself"):
        autotune_accelerator(accelerator, model, loader, 96, world_size=2)


def test_an_empty_dataloader_is_refused(accelerator: Any) -> None:
    model, _, _ = mlp_setup()
    empty = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(0, 32), torch.zeros(0, dtype=torch.long))
    )
    with pytest.raises(ConfigError, match="gave no batch"):
        autotune_accelerator(accelerator, model, empty, 96, loss_fn=F.cross_entropy)


def test_a_short_last_step_is_said_and_weighted_as_said(
    accelerator: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # 24 rows, 4 x 4 planned: an epoch is a step of 4 micro-batches, then one of 2. Accelerate
    # divides every loss by 4, so that step applies 2/4 of its mean gradient (an update of
    # -15.375 where its mean is 30.75); the warning says so, with the numbers.
    torch.manual_seed(0)
    weight = torch.nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        weight.weight.zero_()
    optimizer = torch.optim.SGD(weight.parameters(), lr=1.0)
    inputs = torch.arange(1, 25, dtype=torch.float64).unsqueeze(1) * 1.5
    dataset = torch.utils.data.TensorDataset(inputs)
    with caplog.at_level("WARNING", logger="autobatch.integrations"):
        plan = autotune_accelerator(
            accelerator,
            weight,
            torch.utils.data.DataLoader(dataset, batch_size=2),
            16,
            optimizer=optimizer,
            train_step=lambda model, batch: model(batch[0]).mean(),
            device="sim:64MiB",
            max_micro_batch_size=4,
            use_store=False,
        )
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (4, 4)
    assert plan.epoch is not None and plan.epoch.last_step_micro_batches == 2
    (record,) = [r for r in caplog.records if "autotune_accelerator" in r.getMessage()]
    message = record.getMessage()
    assert "then a last one of 8 samples (2 micro-batch(es) per rank)" in message
    assert "divides every micro-batch's loss by 4" in message
    assert "j/4 of their mean gradient" in message

    model, optimizer, loader = accelerator.prepare(
        weight, optimizer, torch.utils.data.DataLoader(dataset, batch_size=4)
    )
    updates = []
    for (batch,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).mean())
            before = float(model.weight)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                updates.append(float(model.weight) - before)
    last_mean = float(inputs[16:].mean())  # 30.75: its update would be -30.75
    assert updates[-1] == pytest.approx(-last_mean * 2 / 4, abs=1e-12)  # 2 of 4, as said
