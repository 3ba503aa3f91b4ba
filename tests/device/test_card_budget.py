"""The budget of a card named from outside the job (built in device/): one
NVML reading of a local GPU, or a node's GPU feature discovery labels; pure, no service."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import pytest

from autobatch.device import (
    UNKNOWN_MEMORY,
    CardBudget,
    GpuInfo,
    LabelError,
    MemoryInfo,
    budget_from_labels,
    budget_from_nvml,
)
from autobatch.errors import ConfigError, DeviceUnavailableError

GiB = 2**30
MiB = 2**20
TIME_SLICED = {
    "nvidia.com/gpu.memory": str(80 * 1024),
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-SHARED",
    "nvidia.com/gpu.replicas": "4",
    "nvidia.com/gpu.sharing-strategy": "time-slicing",
}


def card(
    total: int | None,
    free: int | None,
    used: int | None = 0,
    *,
    cuda_index: int | None = 0,
    used_includes_reserved: bool = False,
) -> GpuInfo:
    memory = MemoryInfo(
        total_memory_bytes=total,
        free_memory_bytes=free,
        used_memory_bytes=used,
        used_includes_reserved=used_includes_reserved,
    )
    return GpuInfo(
        nvml_index=3,
        cuda_index=cuda_index,
        uuid="GPU-80",
        name="NVIDIA A100-SXM4-80GB",
        memory=memory,
    )


def nvml(
    gpu: GpuInfo,
    *,
    memory: Literal["total", "free"] = "total",
    gpu_fraction: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> CardBudget:
    return budget_from_nvml(
        gpu, memory=memory, gpu_fraction=gpu_fraction, environ={} if environ is None else environ
    )


def test_a_card_others_use_is_planned_whole_for_total_with_a_note_and_free_for_free() -> None:
    gpu = card(80 * GiB, 50 * GiB, 30 * GiB)

    whole = nvml(gpu)
    now = nvml(gpu, memory="free")

    assert (whole.budget.budget_bytes, now.budget.budget_bytes) == (80 * GiB, 50 * GiB)
    assert whole.budget.deciding_source == now.budget.deciding_source == "nvml"
    assert whole.budget.sharing_mode == "shared"  # 30 GiB held: free is 37.5% under total
    assert whole.budget.free_now_bytes == 50 * GiB
    assert whole.budget.unseen_sources == ("cuda_runtime",)
    assert whole.note is not None and "other processes hold 30.00 GiB (32212254720 bytes)" in (
        whole.note
    )
    assert now.note is None
    assert (whole.source, whole.name, whole.uuid, whole.cuda_index) == (
        "nvml",
        "NVIDIA A100-SXM4-80GB",
        "GPU-80",
        0,
    )
    assert (whole.memory_source, whole.memory_held_by_others_bytes) == ("nvml", 30 * GiB)
    assert whole.budget.readings[0].detail == 'NVIDIA A100-SXM4-80GB GPU-80, memory "total"'


def test_an_idle_card_has_no_note_and_the_v1_api_s_reserve_is_named() -> None:
    assert nvml(card(80 * GiB, 80 * GiB, 0)).note is None
    v1 = nvml(card(80 * GiB, 79 * GiB, GiB, used_includes_reserved=True))
    assert v1.note is not None and "the driver's reserve included" in v1.note
    assert v1.budget.sharing_mode == "none"  # 1.25% held: under the 5% tolerance


def test_a_vgpu_limit_for_the_card_s_cuda_index_decides() -> None:
    environ = {"CUDA_DEVICE_MEMORY_LIMIT_1": "3g", "CUDA_DEVICE_MEMORY_LIMIT_0": "5g"}

    limited = nvml(card(10 * GiB, 10 * GiB, cuda_index=1), environ=environ)
    outside = nvml(card(10 * GiB, 10 * GiB, cuda_index=None), environ=environ)

    assert (limited.budget.budget_bytes, limited.budget.deciding_source) == (3 * GiB, "vgpu_limit")
    assert limited.budget.sharing_mode == "virtualised"
    assert [r.source for r in limited.budget.readings] == ["nvml", "vgpu_limit"]
    assert outside.budget.budget_bytes == 10 * GiB  # no CUDA index: no variable of its own
    assert [r.source for r in outside.budget.readings] == ["nvml"]


def test_a_declared_fraction_is_of_the_card_s_total() -> None:
    half = nvml(card(24 * GiB, 20 * GiB), gpu_fraction=0.5, memory="free")
    assert (half.budget.budget_bytes, half.budget.deciding_source) == (12 * GiB, "gpu_fraction")
    assert half.budget.sharing_mode == "fractional"
    assert half.budget.card_memory_bytes == 24 * GiB
    assert half.budget.readings[-1].detail == "gpu_fraction=0.5 declared"


def test_a_mig_instance_names_its_profile() -> None:
    memory = MemoryInfo(total_memory_bytes=5 * GiB, free_memory_bytes=5 * GiB, used_memory_bytes=0)
    gpu = GpuInfo(
        nvml_index=0,
        cuda_index=0,
        uuid="MIG-1",
        name="NVIDIA A100 MIG 1g.5gb",
        memory=memory,
        is_mig=True,
        mig_profile="1g.5gb",
    )
    assert nvml(gpu).mig_profile == "1g.5gb"
    assert nvml(card(GiB, GiB)).mig_profile is None


def test_unknown_memory_or_an_unreadable_vgpu_limit_is_memory_unknown() -> None:
    gpu = GpuInfo(
        nvml_index=0,
        cuda_index=0,
        uuid="GPU-9",
        name="NVIDIA GB10",
        memory=UNKNOWN_MEMORY,
        memory_reason="not_supported",
        memory_detail="NVML reports no memory",
    )
    with pytest.raises(
        DeviceUnavailableError, match=r"GPU GPU-9 is unknown \(not_supported: NVML reports"
    ) as unknown:
        nvml(gpu)
    with pytest.raises(DeviceUnavailableError, match="is not a memory limit") as unreadable:
        nvml(card(GiB, GiB), environ={"CUDA_DEVICE_MEMORY_LIMIT_0": "lots"})
    assert unknown.value.reason == unreadable.value.reason == "memory_unknown"
    assert isinstance(unreadable.value.__cause__, ConfigError)


def test_nothing_free_is_no_free_memory_and_a_bad_fraction_a_config_error() -> None:
    with pytest.raises(DeviceUnavailableError, match="GPU GPU-80 has no free memory") as caught:
        nvml(card(80 * GiB, 0, 80 * GiB), memory="free")
    assert caught.value.reason == "no_free_memory"
    with pytest.raises(ConfigError, match=r"gpu_fraction 1\.5 must be a number in \(0, 1\]"):
        nvml(card(GiB, GiB), gpu_fraction=1.5)


def labels(
    labels: dict[str, str], *, mig_profile: str | None = None, gpu_fraction: float | None = None
) -> CardBudget:
    return budget_from_labels(labels, mig_profile=mig_profile, gpu_fraction=gpu_fraction, gpus=[])


def test_a_time_sliced_card_is_planned_as_its_replica_s_share() -> None:
    shared = labels(TIME_SLICED)
    assert (shared.budget.budget_bytes, shared.budget.card_memory_bytes) == (20 * GiB, 80 * GiB)
    assert (shared.budget.deciding_source, shared.budget.sharing_mode) == (
        "time_slicing",
        "time_sliced",
    )
    assert [r.source for r in shared.budget.readings] == ["node_labels", "time_slicing"]
    assert "among 4 replicas (time-slicing," in shared.budget.readings[1].detail
    assert (shared.source, shared.name, shared.uuid, shared.warnings) == (
        "node_labels",
        "NVIDIA-A100-SXM4-80GB",
        None,
        (),
    )
    assert shared.budget.unseen_sources == ("cuda_runtime",)


def test_a_shared_card_without_replicas_needs_the_declared_share() -> None:
    unsaid = {k: v for k, v in TIME_SLICED.items() if k != "nvidia.com/gpu.replicas"}
    with pytest.raises(LabelError, match="never planned as the whole card") as caught:
        labels(unsaid)
    assert caught.value.field == "gpu_fraction"

    quarter = labels(unsaid, gpu_fraction=0.25)
    assert (quarter.budget.budget_bytes, quarter.budget.deciding_source) == (
        20 * GiB,
        "gpu_fraction",
    )
    assert quarter.budget.sharing_mode == "fractional"


def test_a_labelled_mig_slice_shared_by_replicas_and_a_label_in_bytes() -> None:
    mig = {
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/gpu.product": "A100-SXM4-40GB",
        "nvidia.com/gpu.memory": "40537",
        "nvidia.com/mig-1g.5gb.memory": "4864",
        "nvidia.com/mig-1g.5gb.replicas": "2",
    }
    slice_ = labels(mig, mig_profile="1g.5gb")
    assert slice_.budget.budget_bytes == 4864 * MiB // 2
    assert (slice_.name, slice_.mig_profile) == ("A100-SXM4-40GB-MIG-1g.5gb", "1g.5gb")
    with pytest.raises(LabelError, match="give device.mig_profile") as caught:
        labels(mig)
    assert caught.value.field == "mig_profile"

    in_bytes = labels({"nvidia.com/gpu.memory": "42505273344"})
    assert in_bytes.budget.budget_bytes == 42505273344
    assert len(in_bytes.warnings) == 1 and "read as bytes" in in_bytes.warnings[0]
    assert in_bytes.budget.sharing_mode == "none"
