"""GPU feature discovery labels read into bytes: MiB or bytes, NVML over a wrong label, MIG slices,
replicas; pure, no service."""

from __future__ import annotations

import pickle

import pytest

from autobatch.device import GpuInfo, LabelError, MemoryInfo, read_node_labels
from autobatch.errors import ConfigError

GiB = 2**30
MiB = 2**20
A100_40 = "NVIDIA A100-SXM4-40GB"
# GFD's labels on a 40 GB A100 under the mixed MIG strategy (values as GFD writes them).
MIXED = {
    "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/gpu.product": "A100-SXM4-40GB",
    "nvidia.com/gpu.memory": "40537",
    "nvidia.com/mig-1g.5gb.count": "4",
    "nvidia.com/mig-1g.5gb.memory": "4864",
    "nvidia.com/mig-2g.10gb.count": "2",
    "nvidia.com/mig-2g.10gb.memory": "9984",
}


def gpu(name: str, total_bytes: int, *, is_mig: bool = False) -> GpuInfo:
    memory = MemoryInfo(
        total_memory_bytes=total_bytes, free_memory_bytes=total_bytes, used_memory_bytes=0
    )
    return GpuInfo(
        nvml_index=0, cuda_index=0, uuid="GPU-x", name=name, memory=memory, is_mig=is_mig
    )


def test_mib_is_mib() -> None:
    device = read_node_labels({"nvidia.com/gpu.memory": "40537"}, mig_profile=None, gpus=[])
    assert device.capacity_bytes == 40537 * MiB
    assert device.warnings == ()


def test_a_value_that_can_only_be_bytes_is_read_as_bytes_with_a_warning() -> None:
    # Some GFD versions wrote bytes: as MiB, 42505273344 would be a 39.6-PiB card.
    device = read_node_labels({"nvidia.com/gpu.memory": "42505273344"}, mig_profile=None, gpus=[])
    assert device.capacity_bytes == 42505273344
    assert len(device.warnings) == 1
    assert "read as bytes" in device.warnings[0] and "42505273344" in device.warnings[0]


def test_a_value_neither_mib_nor_bytes_is_refused() -> None:
    with pytest.raises(LabelError, match="neither MiB") as caught:
        read_node_labels({"nvidia.com/gpu.memory": str(2**51)}, mig_profile=None, gpus=[])
    assert caught.value.field == "node_labels.nvidia.com/gpu.memory"


@pytest.mark.parametrize(
    ("label_mib", "nvml_bytes", "expected", "num_warnings"),
    [
        ("20268", 40 * GiB, 40 * GiB, 1),  # half the card: NVML wins
        ("40537", 40 * GiB, 40537 * MiB, 0),  # 1% apart: the label stands
        ("39000", 40 * GiB, 39000 * MiB, 0),  # 4.8% apart: still the label
        ("38000", 40 * GiB, 40 * GiB, 1),  # 7.2% apart: NVML
    ],
)
def test_nvml_wins_when_it_sees_the_card_and_disagrees_by_over_5_percent(
    label_mib: str, nvml_bytes: int, expected: int, num_warnings: int
) -> None:
    labels = {"nvidia.com/gpu.product": "A100-SXM4-40GB", "nvidia.com/gpu.memory": label_mib}
    device = read_node_labels(labels, mig_profile=None, gpus=[gpu(A100_40, nvml_bytes)])
    assert device.capacity_bytes == expected
    assert len(device.warnings) == num_warnings


def test_nvml_of_another_card_or_of_a_slice_does_not_override_the_label() -> None:
    labels = {"nvidia.com/gpu.product": "A100-SXM4-40GB", "nvidia.com/gpu.memory": "20268"}
    others = [gpu("NVIDIA H100 NVL", 94 * GiB), gpu(f"{A100_40} MIG 1g.5gb", 5 * GiB, is_mig=True)]
    device = read_node_labels(labels, mig_profile=None, gpus=others)
    assert device.capacity_bytes == 20268 * MiB


def test_a_mixed_mig_node_plans_for_the_slice() -> None:
    device = read_node_labels(MIXED, mig_profile="1g.5gb", gpus=[gpu(A100_40, 40 * GiB)])
    assert device.capacity_bytes == 4864 * MiB  # the slice, not the 40 GB card
    assert device.name == "A100-SXM4-40GB-MIG-1g.5gb"
    seen = [gpu(f"{A100_40} MIG 1g.5gb", 10 * GiB, is_mig=True)]  # NVML disagrees on the slice
    assert read_node_labels(MIXED, mig_profile="1g.5gb", gpus=seen).capacity_bytes == 10 * GiB


@pytest.mark.parametrize(
    ("mig_profile", "pattern"),
    [
        (None, r"shows MIG slices \(mixed strategy\): 1g\.5gb \(4864 MiB\), 2g\.10gb \(9984 MiB\)"),
        ("3g.20gb", "'3g.20gb' is not among the node's MIG slices"),
    ],
)
def test_a_mixed_mig_node_needs_a_known_slice(mig_profile: str | None, pattern: str) -> None:
    with pytest.raises(LabelError, match=pattern) as caught:
        read_node_labels(MIXED, mig_profile=mig_profile, gpus=[])
    assert caught.value.field == "mig_profile"


@pytest.mark.parametrize(
    ("extra", "replicas", "shared", "strategy"),
    [
        ({}, 1, False, ""),
        ({"nvidia.com/gpu.replicas": "4"}, 4, True, ""),
        ({"nvidia.com/gpu.sharing-strategy": "none"}, 1, False, ""),
        ({"nvidia.com/gpu.sharing-strategy": "mps"}, 1, True, "mps"),
        ({"nvidia.com/gpu.product": "NVIDIA-L4-SHARED"}, 1, True, ""),
    ],
)
def test_replicas_and_sharing_are_read_from_the_labels(
    extra: dict[str, str], replicas: int, shared: bool, strategy: str
) -> None:
    labels = {"nvidia.com/gpu.memory": "24576", **extra}
    device = read_node_labels(labels, mig_profile=None, gpus=[])
    assert (device.replicas, device.shared, device.sharing_strategy) == (
        replicas,
        shared,
        strategy,
    )
    assert device.capacity_bytes == 24 * GiB
    assert device.name == ("NVIDIA-L4" if "nvidia.com/gpu.product" in extra else None)


@pytest.mark.parametrize("value", ["four", "0", "-1", "2.5"])
def test_a_replicas_label_that_is_not_a_count_is_refused_naming_it(value: str) -> None:
    labels = {"nvidia.com/gpu.memory": "24576", "nvidia.com/gpu.replicas": value}
    with pytest.raises(LabelError, match=r"must be the number of replicas .* got") as caught:
        read_node_labels(labels, mig_profile=None, gpus=[])
    assert caught.value.field == "node_labels.nvidia.com/gpu.replicas"


def test_a_label_error_is_a_config_error_that_keeps_its_field_through_pickle() -> None:
    with pytest.raises(ConfigError, match="is missing") as caught:
        read_node_labels({}, mig_profile=None, gpus=[])
    assert isinstance(caught.value, LabelError)
    copied = pickle.loads(pickle.dumps(caught.value))
    assert (str(copied), copied.field) == (str(caught.value), "node_labels.nvidia.com/gpu.memory")
