"""torch.compile'd models: a probe or an estimate leaves Dynamo working for that model and every
later one, measures (or confirms) the compiled step, and compiles once for all sizes.

Frames are counted with ``torch._dynamo.testing.CompileCounterWithBackend("eager")``: Dynamo
traces as it would for inductor, but the backend runs the graph as is, so the tests stay cheap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from autobatch import autotune, estimate, probe
from autobatch.device import Capacity, PeakMemory
from autobatch.errors import StepFailedError
from autobatch.probing._compiled import eager, is_compiled
from autobatch.store._store import ProfileStore


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


SAMPLE = (torch.randn(4, 32), torch.randint(0, 10, (4,)))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiles_later() -> int:
    """Frames Dynamo compiles for a new model compiled now (0 when the process is poisoned)."""
    counter = CompileCounterWithBackend("eager")
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(32, 8)), backend=counter)
    model(torch.randn(3, 32))
    return counter.frame_count


def test_a_probe_of_a_compiled_model_leaves_compilation_working() -> None:
    eager_profile = probe(_mlp(), SAMPLE, loss_fn=F.cross_entropy, device="sim:4MiB")
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_mlp(), backend=counter)

    profile = probe(compiled, SAMPLE, loss_fn=F.cross_entropy, device="sim:4MiB")

    # Trials ran eagerly (bytes counted by a dispatch mode): the same answer as the eager model.
    assert profile.max_micro_batch_size == eager_profile.max_micro_batch_size > 100
    assert profile.compiled == "confirmed"
    assert eager_profile.compiled == ""
    assert f"ran at micro-batch {profile.recommended_micro_batch_size}" in profile.notes[-1]
    assert counter.frame_count == 1  # the confirming step, at the chosen size
    compiled(torch.randn(5, 32))
    assert counter.frame_count == 2  # the compiled model still compiles (a new shape)
    assert compiles_later() == 1  # and so does any model compiled later


def test_a_model_compiled_in_place_is_probed_and_still_compiles() -> None:
    counter = CompileCounterWithBackend("eager")
    model = _mlp()
    model.compile(backend=counter)
    assert is_compiled(model)

    profile = probe(model, SAMPLE, loss_fn=F.cross_entropy, device="sim:4MiB")

    assert profile.compiled == "confirmed"
    assert compiles_later() == 1


def test_an_estimate_of_a_compiled_model_leaves_compilation_working() -> None:
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_mlp(), backend=counter)

    found = estimate(compiled, SAMPLE, loss_fn=F.cross_entropy, capacity_bytes=4 << 20)

    want = estimate(_mlp(), SAMPLE, loss_fn=F.cross_entropy, capacity_bytes=4 << 20)
    assert found.max_micro_batch_size == want.max_micro_batch_size
    assert "uncompiled step" in found.notes[-1]
    assert counter.frame_count == 0  # nothing compiled, nothing skipped
    compiled(torch.randn(5, 32))
    assert counter.frame_count == 1
    assert compiles_later() == 1


def test_eager_restores_the_previous_stance() -> None:
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_mlp(), backend=counter)
    with eager():
        compiled(torch.randn(2, 32))
    assert counter.frame_count == 0
    compiled(torch.randn(2, 32))
    assert counter.frame_count == 1


def test_a_compiled_step_that_fails_after_eager_trials_is_an_error_naming_compile() -> None:
    def no_compile(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        raise RuntimeError("backend exploded")

    compiled = torch.compile(_mlp(), backend=no_compile)
    with pytest.raises(StepFailedError, match=r"torch.compile'd step failed at the chosen"):
        probe(compiled, SAMPLE, loss_fn=F.cross_entropy, device="sim:4MiB")
    assert compiles_later() == 1


class AllocatorStatsDevice:
    """A CUDA-like device that reads peak memory after the step, without a dispatch mode (as the
    allocator statistics do): ``fixed_bytes + bytes_per_sample * n``, n set by the step."""

    name = "fake-cuda"
    type = "cuda"
    torch_device = torch.device("cpu")
    driver_version = ""

    def __init__(self, *, capacity_bytes: int, fixed_bytes: int, bytes_per_sample: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.fixed_bytes = fixed_bytes
        self.bytes_per_sample = bytes_per_sample
        self.micro_batch_size = 0

    def peak(self, micro_batch_size: int) -> int:
        return self.fixed_bytes + self.bytes_per_sample * micro_batch_size

    def capacity(self) -> Capacity:
        return Capacity(total_memory_bytes=self.capacity_bytes, capacity_bytes=self.capacity_bytes)

    @contextmanager
    def measure(self, resident: Sequence[torch.Tensor]) -> Iterator[PeakMemory]:
        peak = PeakMemory()
        try:
            yield peak
        finally:
            peak.allocated_bytes = peak.reserved_bytes = self.peak(self.micro_batch_size)

    def release(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def clock(self) -> float:
        return 0.0

    @property
    def steps_scale_with_size(self) -> bool:
        return False


def test_on_cuda_the_trials_measure_the_compiled_step_and_compile_once_for_all_sizes() -> None:
    device = AllocatorStatsDevice(
        capacity_bytes=1000 + 10 * 300, fixed_bytes=1000, bytes_per_sample=10
    )
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_mlp(), backend=counter)

    def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        device.micro_batch_size = inputs.shape[0]
        if device.peak(inputs.shape[0]) > device.capacity_bytes:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return F.cross_entropy(model(inputs), targets)

    profile = probe(compiled, SAMPLE, train_step=step, device=device, use_estimate=False)

    sizes = {t.micro_batch_size for t in profile.trials}
    assert profile.max_micro_batch_size == 300
    assert profile.compiled == "measured"
    assert [t.micro_batch_size for t in profile.trials if t.warm_up] == [1, 2]
    assert len(sizes) >= 6  # many sizes...
    assert counter.frame_count == 2  # ...one graph for size 1, one dynamic graph for the rest
    assert "its batch dimension dynamic" in profile.notes[0]
    assert compiles_later() == 1


def test_a_compiled_step_has_its_own_entry_in_the_store(tmp_path: Path) -> None:
    store = tmp_path / "profiles.sqlite3"
    options: dict[str, Any] = {
        "effective_batch_size": 64,
        "loss_fn": F.cross_entropy,
        "device": "sim:4MiB",
        "store": store,
    }
    eager_plan = autotune(_mlp(), SAMPLE, **options)
    model = _mlp()
    model.compile(backend=CompileCounterWithBackend("eager"))  # same fingerprint as eager

    first = autotune(model, SAMPLE, **options)
    again = autotune(model, SAMPLE, **options)

    assert (eager_plan.source, first.source, again.source) == ("measured", "measured", "cached")
    with ProfileStore(store) as opened:
        assert sorted(p.compiled for _, p in opened.list_profiles()) == ["", "confirmed"]
