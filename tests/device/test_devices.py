"""The CPU and simulated devices, the live-byte tracker, and device specs."""

from __future__ import annotations

import pytest
import torch

from autobatch.device import ParsedDevice, parse_device, resolve_device
from autobatch.device import _cpu as cpu_module
from autobatch.device._cpu import CpuDevice
from autobatch.device._live_bytes import LiveBytes
from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError
from autobatch.probing._prober import probe


def test_live_bytes_counts_each_storage_once_and_forgets_freed_ones() -> None:
    tracker = LiveBytes(rounding_bytes=1)
    with tracker:
        a = torch.ones(1000)  # 4000 B
        view = a[10:20]  # same storage
        a.add_(1)  # in place: same storage
        b = a * 2  # new 4000 B
        assert tracker.live_bytes == 8000
        del b
        assert tracker.live_bytes == 4000
        c = torch.ones(250)
    assert tracker.peak_bytes == 8000
    assert tracker.live_bytes == 5000
    del a, view, c


def test_live_bytes_rounds_like_the_cuda_allocator() -> None:
    tracker = LiveBytes()
    with tracker:
        x = torch.ones(1)  # 4 B -> one 512 B block
    assert tracker.live_bytes == 512
    del x


def test_simulated_device_raises_torch_oom_and_hands_back_nothing() -> None:
    device = SimulatedDevice(capacity_bytes=10_000)
    kept: list[torch.Tensor] = []
    with (
        pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as info,
        device.measure([]) as peak,
    ):
        kept.append(torch.ones(1000))  # 4096 B with rounding
        kept.append(torch.ones(2000))  # 8192 B: over
    assert len(kept) == 1  # the failed allocation returned no tensor
    assert peak.allocated_bytes == 4096
    assert device.num_ooms == 1
    assert "Simulated device sim has a total capacity of 9.77 KiB" in str(info.value)


def test_cpu_device_stops_before_the_host_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_module, "read_meminfo", lambda path=None: (1 << 30, 100_000))
    device = CpuDevice()
    with (
        pytest.raises(torch.OutOfMemoryError, match="host memory would be exhausted"),
        device.measure([]),
    ):
        torch.ones(50_000)  # 200 kB > 100 kB available


def test_probe_on_the_cpu_stops_at_the_limit() -> None:
    profile = probe(
        torch.nn.Linear(16, 16),
        torch.randn(2, 16),
        loss_fn=lambda out: out.pow(2).mean(),
        device="cpu",
        max_micro_batch_size=300,
    )
    assert profile.max_micro_batch_size == 300
    assert profile.device_type == "cpu"
    assert profile.stop_reason == "limit max_micro_batch_size=300 reached"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("sim:2GiB", 2 * 2**30), ("sim:512MiB", 512 * 2**20), (" sim:1G ", 2**30)],
)
def test_resolve_simulated(spec: str, expected: int) -> None:
    device = resolve_device(spec)
    assert device.type == "sim"
    assert device.capacity().capacity_bytes == expected


@pytest.mark.parametrize("spec", ["sim", "sim:", "gpu:0", "cuda:x", 3])
def test_resolve_rejects(spec: object) -> None:
    with pytest.raises(ConfigError, match="device"):
        resolve_device(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cuda:3", ParsedDevice(type="cuda", cuda_index=3)),
        ("cuda", ParsedDevice(type="cuda", cuda_index=0)),
        ("cuda:01", ParsedDevice(type="cuda", cuda_index=1)),
        (" cpu ", ParsedDevice(type="cpu")),
        ("sim:1.5GiB", ParsedDevice(type="sim", capacity_bytes=3 * 2**29)),
        ("sim:16 MiB", ParsedDevice(type="sim", capacity_bytes=16 * 2**20)),
    ],
)
def test_parse_device(text: str, expected: ParsedDevice) -> None:
    assert parse_device(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu:0", "not understood"),
        ("cuda:-1", "CUDA index must be a number"),
        ("sim:0", "memory size"),
        ("tpu", "not understood"),
    ],
)
def test_parse_device_rejects_with_the_value_and_the_forms(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_device(text)


def test_simulated_oom_is_recognised_by_peers_that_match_on_the_message() -> None:
    lightning_memory = pytest.importorskip("lightning.pytorch.utilities.memory")
    accelerate_memory = pytest.importorskip("accelerate.utils.memory")
    device = SimulatedDevice(capacity_bytes=1 << 20)
    with pytest.raises(torch.OutOfMemoryError) as info, device.measure([]):
        torch.zeros(1 << 20)
    assert lightning_memory.is_oom_error(info.value)
    assert accelerate_memory.should_reduce_batch_size(info.value)
