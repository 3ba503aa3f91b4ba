"""autobatch.device._nvml against a hand-written fake pynvml; the pure CUDA capacity arithmetic."""

from __future__ import annotations

import ctypes.util
import os
import pickle
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import autobatch.device._nvml as nvml_module
from autobatch.device import UNKNOWN_MEMORY, Capacity, MemoryInfo
from autobatch.device._cuda import CudaDevice, usable_capacity
from autobatch.device._nvml import REASONS, Nvml
from autobatch.errors import DeviceUnavailableError
from tests.helpers.fake_pynvml import ERROR_CLASSES, FakeGpu, FakePynvml, GiB, MiB

REPO_ROOT = Path(__file__).resolve().parents[2]
UNAVAILABLE = r"NVML is not available: libnvidia-ml.so.1 was not found: run the container with"
NO_NVML_REASONS = {
    "NVMLError_LibraryNotFound": "library_missing",
    "NVMLError_DriverNotLoaded": "driver_not_loaded",
    "NVMLError_LibRmVersionMismatch": "driver_library_mismatch",
}
QUERY_REASONS = {
    "NVMLError_GpuIsLost": "gpu_lost",
    "NVMLError_ResetRequired": "gpu_lost",
    "NVMLError_GpuNotFound": "gpu_lost",
    "NVMLError_NoPermission": "no_permission",
    "NVMLError_NotSupported": "not_supported",
    "NVMLError_FunctionNotFound": "not_supported",
    "NVMLError_Timeout": "nvml_timeout",
}


def three_gpus() -> list[FakeGpu]:
    """Three different cards, so a wrong index mapping shows in names and bytes."""
    return [
        FakeGpu(uuid="GPU-aaaa-1111", name="NVIDIA A100-SXM4-80GB", total=80 * GiB, free=70 * GiB),
        FakeGpu(uuid="GPU-bbbb-2222", name="NVIDIA L4", total=24 * GiB, free=20 * GiB),
        FakeGpu(uuid="GPU-cccc-3333", name="NVIDIA H100 80GB HBM3", total=81 * GiB, free=3 * GiB),
    ]


def cuda_indices(gpus: list[object]) -> dict[str, int | None]:
    return {gpu.uuid: gpu.cuda_index for gpu in gpus}  # type: ignore[attr-defined]


# --- listing and memory ---------------------------------------------------------------------


def test_lists_every_gpu_with_its_own_bytes() -> None:
    gpus = Nvml(FakePynvml(three_gpus()), environ={}).list_gpus()

    assert [(g.nvml_index, g.cuda_index, g.uuid, g.name) for g in gpus] == [
        (0, 0, "GPU-aaaa-1111", "NVIDIA A100-SXM4-80GB"),
        (1, 1, "GPU-bbbb-2222", "NVIDIA L4"),
        (2, 2, "GPU-cccc-3333", "NVIDIA H100 80GB HBM3"),
    ]
    assert [g.memory.total_memory_bytes for g in gpus] == [80 * GiB, 24 * GiB, 81 * GiB]
    assert [g.memory.free_memory_bytes for g in gpus] == [70 * GiB, 20 * GiB, 3 * GiB]
    assert not any(g.is_mig for g in gpus)


def idle_80gib_card(**errors: type[Exception]) -> FakeGpu:
    """The field case: v1 used ~0.9 GiB (with the driver's reserve), v2 reserved 904 MiB, used 8."""
    return FakeGpu(
        uuid="GPU-idle",
        name="NVIDIA H100 80GB HBM3",
        total=80 * GiB,
        free=80 * GiB - 912 * MiB,
        used_v2=8 * MiB,
        reserved_v2=904 * MiB,
        **errors,  # type: ignore[arg-type]
    )


def test_memory_v2_keeps_the_driver_reserve_apart_and_free_is_the_drivers_field() -> None:
    fake = FakePynvml([idle_80gib_card()])
    (gpu,) = Nvml(fake, environ={}).list_gpus()

    assert gpu.memory == MemoryInfo(
        total_memory_bytes=80 * GiB,
        free_memory_bytes=80 * GiB - 912 * MiB,  # not total - used (which would be 80 GiB - 8 MiB)
        used_memory_bytes=8 * MiB,
        reserved_memory_bytes=904 * MiB,
    )
    assert fake.memory_calls == [("GPU-idle", fake.nvmlMemory_v2)]


@pytest.mark.parametrize(
    "v2_error",
    ["NVMLError_FunctionNotFound", "NVMLError_NotSupported", "NVMLError_ArgumentVersionMismatch"],
)
def test_memory_falls_back_to_v1_when_the_driver_lacks_v2(v2_error: str) -> None:
    fake = FakePynvml([idle_80gib_card(memory_v2_error=ERROR_CLASSES[v2_error])])
    (gpu,) = Nvml(fake, environ={}).list_gpus()

    assert gpu.memory == MemoryInfo(
        total_memory_bytes=80 * GiB,
        free_memory_bytes=80 * GiB - 912 * MiB,  # the same free as v2
        used_memory_bytes=912 * MiB,
        reserved_memory_bytes=None,  # not measured: v1's used includes it
        used_includes_reserved=True,
    )
    assert fake.memory_calls == [("GPU-idle", fake.nvmlMemory_v2), ("GPU-idle", None)]


def no_memory_info() -> dict[str, type[Exception]]:
    not_supported = ERROR_CLASSES["NVMLError_NotSupported"]
    return {"memory_v2_error": not_supported, "memory_v1_error": not_supported}


def test_memory_not_supported_falls_back_to_torch_for_a_visible_device() -> None:
    gpus = three_gpus()
    gpus[2] = FakeGpu(uuid="GPU-cccc-3333", name="NVIDIA GB10", total=1, free=1, **no_memory_info())
    asked: list[str] = []

    def torch_mem_get_info(uuid: str) -> tuple[int, int] | None:
        asked.append(uuid)
        return 100 * GiB, 119 * GiB  # (free, total), torch's order

    nvml = Nvml(
        FakePynvml(gpus),
        environ={"CUDA_VISIBLE_DEVICES": "2,0"},
        torch_mem_get_info=torch_mem_get_info,
    )
    gpu = nvml.gpu_for_cuda_index(0)

    assert gpu.uuid == "GPU-cccc-3333"
    assert gpu.memory == MemoryInfo(
        total_memory_bytes=119 * GiB,
        free_memory_bytes=100 * GiB,
        used_memory_bytes=19 * GiB,
        used_includes_reserved=True,
        memory_source="cuda_runtime",
    )
    assert gpu.memory_reason == "not_supported"
    assert asked == ["GPU-cccc-3333"]  # torch is asked by UUID, never by an index of its own


def test_an_unreadable_gpu_is_listed_with_unknown_memory_and_never_hides_the_others() -> None:
    # GB10-like board without unified addressing reported, torch cannot see it: unknown.
    gpus = three_gpus()
    gpus[1] = FakeGpu(uuid="GPU-bbbb-2222", name="NVIDIA GB10", total=0, free=0, **no_memory_info())
    nvml = Nvml(FakePynvml(gpus), environ={}, torch_mem_get_info=lambda uuid: None)

    listed = nvml.list_gpus()
    assert [g.uuid for g in listed] == ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]
    unreadable = listed[1]
    assert unreadable.memory == UNKNOWN_MEMORY
    assert unreadable.memory.total_memory_bytes is None  # never a capacity of 0
    assert (unreadable.memory_reason, unreadable.memory.memory_source) == (
        "not_supported",
        "unknown",
    )
    assert "NotSupported" in unreadable.memory_detail
    assert listed[2].memory.total_memory_bytes == 81 * GiB  # the healthy H100 beside it
    assert nvml.gpu_for_cuda_index(2).memory.free_memory_bytes == 3 * GiB


def test_a_total_of_zero_is_unknown_never_a_capacity_of_zero() -> None:
    gpus = [FakeGpu(uuid="GPU-zero", name="NVIDIA GB10", total=0, free=0)]
    (gpu,) = Nvml(FakePynvml(gpus), environ={}, torch_mem_get_info=lambda uuid: None).list_gpus()
    assert gpu.memory.total_memory_bytes is None
    assert gpu.memory_reason == "zero_total"


def test_unified_memory_board_reports_the_hosts_available_memory() -> None:
    board = FakeGpu(
        uuid="GPU-gb10", name="NVIDIA GB10", total=0, free=0, addressing_mode=2, **no_memory_info()
    )
    nvml = Nvml(
        FakePynvml([board]),
        environ={},
        torch_mem_get_info=lambda uuid: None,
        host_memory=lambda: (100 * GiB, 119 * GiB),
    )
    (gpu,) = nvml.list_gpus()
    assert gpu.memory == MemoryInfo(
        total_memory_bytes=119 * GiB,
        free_memory_bytes=100 * GiB,
        used_memory_bytes=19 * GiB,
        used_includes_reserved=True,
        memory_source="host",
        unified_memory=True,
    )
    assert gpu.memory_reason == "not_supported"


def test_memory_not_supported_on_an_invisible_gpu_does_not_ask_torch() -> None:
    gpus = three_gpus()
    gpus[1] = FakeGpu(uuid="GPU-bbbb-2222", name="NVIDIA L4", total=0, free=0, **no_memory_info())
    asked: list[str] = []

    def torch_mem_get_info(uuid: str) -> tuple[int, int] | None:
        asked.append(uuid)
        return 1, 1

    nvml = Nvml(
        FakePynvml(gpus),
        environ={"CUDA_VISIBLE_DEVICES": "0"},
        torch_mem_get_info=torch_mem_get_info,
    )
    assert nvml.list_gpus()[1].memory.memory_source == "unknown"
    assert asked == []


def test_a_lost_gpu_is_listed_with_its_reason_and_read_raises_gpu_lost() -> None:
    gpus = three_gpus()
    gpus[0].memory_v2_error = ERROR_CLASSES["NVMLError_GpuIsLost"]
    nvml = Nvml(FakePynvml(gpus), environ={})

    listed = nvml.list_gpus()
    assert [(g.uuid, g.memory_reason) for g in listed] == [
        ("GPU-aaaa-1111", "gpu_lost"),
        ("GPU-bbbb-2222", ""),
        ("GPU-cccc-3333", ""),
    ]
    with pytest.raises(DeviceUnavailableError, match="GpuIsLost.*drain the node") as excinfo:
        nvml.gpu_for_cuda_index(0)
    assert excinfo.value.reason == "gpu_lost"


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, {"GPU-aaaa-1111": 0, "GPU-bbbb-2222": 1, "GPU-cccc-3333": 2}),
        ("2,0", {"GPU-aaaa-1111": 1, "GPU-bbbb-2222": None, "GPU-cccc-3333": 0}),
        (" 1 , 2 ", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": 0, "GPU-cccc-3333": 1}),
        ("1gpu,0", {"GPU-aaaa-1111": 1, "GPU-bbbb-2222": 0, "GPU-cccc-3333": None}),
        ("GPU-cccc-3333,GPU-aaaa", {"GPU-aaaa-1111": 1, "GPU-bbbb-2222": None, "GPU-cccc-3333": 0}),
        ("1,x,0", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": 0, "GPU-cccc-3333": None}),
        ("2,7,0", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": None, "GPU-cccc-3333": 0}),
        ("1,-1,0", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": 0, "GPU-cccc-3333": None}),
        ("GPU-", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": None, "GPU-cccc-3333": None}),
        ("1,1", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": None, "GPU-cccc-3333": None}),
        ("", {"GPU-aaaa-1111": None, "GPU-bbbb-2222": None, "GPU-cccc-3333": None}),
    ],
    ids=[
        "unset",
        "reorder",
        "spaces",
        "strtoul",
        "uuid-prefix",
        "stop-at-junk",
        "stop-at-range",
        "stop-at-negative",
        "ambiguous-uuid",
        "duplicate",
        "empty",
    ],
)
def test_cuda_visible_devices_maps_cuda_index_to_gpu(
    visible: str | None, expected: dict[str, int | None]
) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    gpus = Nvml(FakePynvml(three_gpus()), environ=environ).list_gpus()

    assert cuda_indices(gpus) == expected
    assert [g.nvml_index for g in gpus] == [0, 1, 2]  # NVML's numbering never moves


def test_gpu_for_cuda_index_follows_the_reordering() -> None:
    nvml = Nvml(FakePynvml(three_gpus()), environ={"CUDA_VISIBLE_DEVICES": "2,0"})

    first = nvml.gpu_for_cuda_index(0)
    assert (first.uuid, first.nvml_index, first.memory.free_memory_bytes) == (
        "GPU-cccc-3333",
        2,
        3 * GiB,
    )
    assert nvml.gpu_for_cuda_index(1).memory.total_memory_bytes == 80 * GiB
    with pytest.raises(
        DeviceUnavailableError,
        match=r"CUDA device 2 is not visible: this process sees 2 CUDA device\(s\) "
        r"\(CUDA_VISIBLE_DEVICES='2,0', NVIDIA_VISIBLE_DEVICES=None\)\.",
    ):
        nvml.gpu_for_cuda_index(2)


def test_environment_is_read_at_each_query_when_not_injected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = Nvml(FakePynvml(three_gpus()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert nvml.gpu_for_cuda_index(0).name == "NVIDIA L4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert nvml.gpu_for_cuda_index(0).name == "NVIDIA H100 80GB HBM3"


def test_gpu_for_uuid_accepts_the_uuid_with_or_without_prefix() -> None:
    nvml = Nvml(FakePynvml(three_gpus()), environ={"CUDA_VISIBLE_DEVICES": "1"})

    assert nvml.gpu_for_uuid("GPU-bbbb-2222").cuda_index == 0
    assert nvml.gpu_for_uuid("bbbb-2222").name == "NVIDIA L4"  # torch's uuid has no prefix
    with pytest.raises(DeviceUnavailableError, match="no GPU with UUID 'GPU-zzzz'"):
        nvml.gpu_for_uuid("GPU-zzzz")


# --- NVIDIA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER -------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected", "num_given"),
    [
        # What the NVIDIA container runtime gives a pod, in a privileged pod that sees all cards.
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb-2222"}, {"GPU-bbbb-2222": 0}, 1),
        (
            {"NVIDIA_VISIBLE_DEVICES": "GPU-cccc-3333,GPU-aaaa-1111"},
            {"GPU-aaaa-1111": 0, "GPU-cccc-3333": 1},
            2,
        ),
        ({"NVIDIA_VISIBLE_DEVICES": "2"}, {"GPU-cccc-3333": 0}, 1),
        ({"NVIDIA_VISIBLE_DEVICES": "0,2"}, {"GPU-aaaa-1111": 0, "GPU-cccc-3333": 1}, 2),
        (
            {"NVIDIA_VISIBLE_DEVICES": "all"},
            {"GPU-aaaa-1111": 0, "GPU-bbbb-2222": 1, "GPU-cccc-3333": 2},
            3,
        ),
        ({"NVIDIA_VISIBLE_DEVICES": "none"}, {}, 0),
        # CDI (a DRA claim, the device plugin's CDI mode) sets void and injects the cards
        # itself: NVML sees only those, and they are the container's.
        (
            {"NVIDIA_VISIBLE_DEVICES": "void"},
            {"GPU-aaaa-1111": 0, "GPU-bbbb-2222": 1, "GPU-cccc-3333": 2},
            3,
        ),
        (
            {"NVIDIA_VISIBLE_DEVICES": ""},
            {"GPU-aaaa-1111": 0, "GPU-bbbb-2222": 1, "GPU-cccc-3333": 2},
            3,
        ),
        # then CUDA_VISIBLE_DEVICES indexes the given set
        (
            {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa-1111,GPU-cccc-3333", "CUDA_VISIBLE_DEVICES": "1"},
            {"GPU-cccc-3333": 0},
            2,
        ),
        (
            {"NVIDIA_VISIBLE_DEVICES": "GPU-cccc-3333", "CUDA_VISIBLE_DEVICES": "GPU-bbbb"},
            {},
            1,
        ),
    ],
    ids=[
        "uuid",
        "uuids",
        "index",
        "indices",
        "all",
        "none",
        "void",
        "empty",
        "then-cuda",
        "cuda-outside",
    ],
)
def test_nvidia_visible_devices_is_the_device_set(
    environ: dict[str, str], expected: dict[str, int], num_given: int
) -> None:
    gpus = Nvml(FakePynvml(three_gpus()), environ=environ).list_gpus()

    assert {g.uuid: g.cuda_index for g in gpus if g.cuda_index is not None} == expected
    assert sum(g.given for g in gpus) == num_given
    assert len(gpus) == 3  # the others are listed, marked not given


def test_privileged_pod_lists_the_cards_it_was_not_given_and_says_so() -> None:
    nvml = Nvml(FakePynvml(three_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb-2222"})
    devices, resolved = nvml.visible()

    assert [(d.uuid, d.given) for d in devices] == [
        ("GPU-aaaa-1111", False),
        ("GPU-bbbb-2222", True),
        ("GPU-cccc-3333", False),
    ]
    assert "NVML sees 2 GPU(s) this container was not given" in resolved.note
    assert nvml.gpu_for_cuda_index(0).name == "NVIDIA L4"  # never another pod's card


def test_index_list_in_a_plain_container_means_the_cards_nvml_renumbered() -> None:
    # The runtime exposed host GPU 5 only; NVML inside calls it 0.
    gpus = Nvml(FakePynvml(three_gpus()[:1]), environ={"NVIDIA_VISIBLE_DEVICES": "5"}).list_gpus()
    assert [(g.uuid, g.cuda_index, g.given) for g in gpus] == [("GPU-aaaa-1111", 0, True)]


@pytest.mark.parametrize("spec", ["garbage", "-1", "gpu-aaaa-1111", "0;1"])
def test_garbage_is_not_taken_for_an_index_list_the_runtime_renumbered(spec: str) -> None:
    # One card seen and one token: only an index list means "the cards NVML renumbered"; the
    # same garbage on a node of three gives nothing, so it gives nothing on a node of one.
    for num_gpus in (1, 3):
        nvml = Nvml(FakePynvml(three_gpus()[:num_gpus]), environ={"NVIDIA_VISIBLE_DEVICES": spec})
        devices, resolved = nvml.visible()
        assert [d.given for d in devices] == [False] * num_gpus, (spec, num_gpus)
        assert resolved.cuda_order == ()
        assert f"names devices NVML does not see: {spec}" in resolved.note


def test_a_repeated_index_is_not_two_cards() -> None:
    nvml = Nvml(FakePynvml(three_gpus()[:2]), environ={"NVIDIA_VISIBLE_DEVICES": "0,0"})
    devices, resolved = nvml.visible()
    assert [(d.uuid, d.given) for d in devices] == [
        ("GPU-aaaa-1111", True),
        ("GPU-bbbb-2222", False),
    ]
    assert resolved.cuda_order == ("GPU-aaaa-1111",)


def mixed_node() -> list[FakeGpu]:
    """PCI order: a slow L4 first, then a fast H100."""
    return [
        FakeGpu(
            uuid="GPU-l4",
            name="NVIDIA L4",
            total=24 * GiB,
            free=24 * GiB,
            num_cores=7424,
            max_sm_clock_mhz=2040,
        ),
        FakeGpu(
            uuid="GPU-h100",
            name="NVIDIA H100 80GB HBM3",
            total=80 * GiB,
            free=80 * GiB,
            num_cores=16896,
            max_sm_clock_mhz=1980,
        ),
    ]


@pytest.mark.parametrize(
    ("environ", "cuda_0"),
    [
        ({}, "GPU-h100"),  # CUDA's default, FASTEST_FIRST
        ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, "GPU-h100"),
        ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "GPU-l4"),
        ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}, "GPU-h100"),
        ({"CUDA_VISIBLE_DEVICES": "1"}, "GPU-l4"),
    ],
)
def test_cuda_device_order_is_honoured(environ: dict[str, str], cuda_0: str) -> None:
    nvml = Nvml(FakePynvml(mixed_node()), environ=environ)
    assert nvml.gpu_for_cuda_index(0).uuid == cuda_0
    if "PCI_BUS_ID" not in environ.values():
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in nvml.visible()[1].note


# --- MIG ------------------------------------------------------------------------------------


def mig_machine() -> list[FakeGpu]:
    mig_a = FakeGpu(
        uuid="MIG-aaaa",
        name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        total=40 * GiB - 512 * MiB,
        free=39 * GiB,
    )
    mig_b = FakeGpu(
        uuid="MIG-bbbb",
        name="NVIDIA A100-SXM4-80GB MIG 1g.10gb",
        total=10 * GiB - 256 * MiB,
        free=9 * GiB,
    )
    return [
        FakeGpu(
            uuid="GPU-mig0",
            name="NVIDIA A100-SXM4-80GB",
            total=80 * GiB,
            free=48 * GiB,
            mig_mode=1,
            mig_slots={0: mig_a, 4: mig_b},  # slots 1-3, 5, 6 are empty (NotFound)
        ),
        FakeGpu(
            uuid="GPU-plain", name="NVIDIA L4", total=24 * GiB, free=24 * GiB
        ),  # MIG NotSupported
        FakeGpu(uuid="GPU-off", name="NVIDIA A30", total=24 * GiB, free=23 * GiB, mig_mode=0),
    ]


def test_mig_instances_are_listed_with_their_own_memory() -> None:
    gpus = Nvml(FakePynvml(mig_machine()), environ={}).list_gpus()

    assert [(g.uuid, g.nvml_index, g.is_mig, g.parent_uuid) for g in gpus] == [
        ("GPU-mig0", 0, False, ""),
        ("MIG-aaaa", 0, True, "GPU-mig0"),
        ("MIG-bbbb", 0, True, "GPU-mig0"),
        ("GPU-plain", 1, False, ""),
        ("GPU-off", 2, False, ""),
    ]
    by_uuid = {g.uuid: g for g in gpus}
    assert by_uuid["MIG-aaaa"].memory.total_memory_bytes == 40 * GiB - 512 * MiB
    assert by_uuid["MIG-bbbb"].memory.free_memory_bytes == 9 * GiB
    assert by_uuid["MIG-bbbb"].name == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert [g.mig_profile for g in gpus] == ["", "3g.40gb", "1g.10gb", "", ""]
    # CUDA sees one MIG instance in place of its GPU, not the GPU in MIG mode itself.
    assert cuda_indices(gpus) == {
        "GPU-mig0": None,
        "MIG-aaaa": 0,
        "MIG-bbbb": None,
        "GPU-plain": 1,
        "GPU-off": 2,
    }


@pytest.mark.parametrize(
    ("visible", "expected_cuda_0"),
    [
        ("MIG-bbbb", "MIG-bbbb"),
        ("MIG-bbbb,MIG-aaaa", "MIG-bbbb"),
        ("GPU-plain,MIG-aaaa", "GPU-plain"),
    ],
)
def test_mig_instances_selected_by_uuid(visible: str, expected_cuda_0: str) -> None:
    nvml = Nvml(FakePynvml(mig_machine()), environ={"CUDA_VISIBLE_DEVICES": visible})

    gpu = nvml.gpu_for_cuda_index(0)
    assert gpu.uuid == expected_cuda_0
    gpus = nvml.list_gpus()
    num_visible = sum(g.cuda_index is not None for g in gpus)
    assert num_visible == (2 if visible == "GPU-plain,MIG-aaaa" else 1)  # one MIG per process


def test_mig_parent_without_permission_breaks_nothing() -> None:
    machine = mig_machine()
    no_permission = ERROR_CLASSES["NVMLError_NoPermission"]
    machine[0].memory_v2_error = no_permission  # the parent, as in a MIG container
    machine[0].memory_v1_error = no_permission
    nvml = Nvml(FakePynvml(machine), environ={"NVIDIA_VISIBLE_DEVICES": "MIG-aaaa"})

    gpus = nvml.list_gpus()
    by_uuid = {g.uuid: g for g in gpus}
    assert by_uuid["GPU-mig0"].memory_reason == "no_permission"
    assert by_uuid["GPU-mig0"].memory.total_memory_bytes is None
    instance = nvml.gpu_for_cuda_index(0)
    assert (instance.uuid, instance.mig_profile) == ("MIG-aaaa", "3g.40gb")
    assert instance.memory.total_memory_bytes == 40 * GiB - 512 * MiB
    assert nvml.gpu_for_uuid("MIG-aaaa").memory.free_memory_bytes == 39 * GiB
    assert [g.uuid for g in gpus if g.given] == ["MIG-aaaa"]


# --- errors ---------------------------------------------------------------------------------


def test_fake_has_exactly_the_real_modules_error_classes() -> None:
    import pynvml

    real = {name for name in dir(pynvml) if name.startswith("NVMLError_")}
    assert real == set(ERROR_CLASSES)


@pytest.mark.parametrize("error_name", sorted(ERROR_CLASSES))
def test_every_nvml_error_becomes_device_unavailable_with_a_stable_reason(error_name: str) -> None:
    fake = FakePynvml(three_gpus())
    fake.count_error = ERROR_CLASSES[error_name]()
    reason = NO_NVML_REASONS.get(error_name) or QUERY_REASONS.get(error_name, "nvml_error")
    message = (
        r"NVML is not available: "
        if error_name in NO_NVML_REASONS
        else rf"NVML could not list GPUs: .*\({error_name}\); "
    ) + re.escape(REASONS[reason])

    with pytest.raises(DeviceUnavailableError, match=message) as excinfo:
        Nvml(fake, environ={}).list_gpus()
    assert excinfo.value.__cause__ is fake.count_error
    assert excinfo.value.reason == reason


def test_rm_version_mismatch_is_not_reported_as_a_missing_driver() -> None:
    fake = FakePynvml([], init_errors=[ERROR_CLASSES["NVMLError_LibRmVersionMismatch"]()])
    with pytest.raises(DeviceUnavailableError, match="reload the nvidia kernel modules or reboot"):
        Nvml(fake).driver_version()


def test_the_cuda_toolkit_stub_library_is_named_as_such() -> None:
    stub = "/usr/local/cuda-12.4/targets/x86_64-linux/lib/stubs/libnvidia-ml.so"
    fake = FakePynvml([], init_errors=[ERROR_CLASSES["NVMLError_Unknown"]()])
    nvml = Nvml(fake, loaded_libraries=lambda: ["/usr/lib/libc.so.6", stub])

    with pytest.raises(DeviceUnavailableError, match="stubs directory from LD_LIBRARY_PATH") as e:
        nvml.driver_version()
    assert e.value.reason == "cuda_stub_library"
    assert stub in str(e.value)


def test_device_unavailable_keeps_its_reason_across_pickling() -> None:
    error = DeviceUnavailableError("lost", reason="gpu_lost")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.reason) == ("lost", "gpu_lost")


@pytest.mark.parametrize(
    "error_name",
    ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission"],
)
def test_nvml_errors_at_init_become_device_unavailable(error_name: str) -> None:
    fake = FakePynvml(three_gpus(), init_errors=[ERROR_CLASSES[error_name]()])

    with pytest.raises(DeviceUnavailableError) as excinfo:
        Nvml(fake).driver_version()
    assert isinstance(excinfo.value.__cause__, ERROR_CLASSES[error_name])


def test_library_mismatch_becomes_device_unavailable() -> None:
    fake = FakePynvml(three_gpus())
    fake.count_error = fake.NVMLLibraryMismatchError("Unversioned function called")
    with pytest.raises(DeviceUnavailableError, match="Unversioned function called") as excinfo:
        Nvml(fake, environ={}).list_gpus()
    assert excinfo.value.reason == "bindings_mismatch"


@pytest.mark.parametrize("error", [TypeError("a bug"), KeyError("a bug"), RuntimeError("a bug")])
def test_unrelated_exceptions_propagate(error: Exception) -> None:
    fake = FakePynvml(three_gpus())
    fake.count_error = error
    with pytest.raises(type(error)) as excinfo:
        Nvml(fake, environ={}).list_gpus()
    assert excinfo.value is error


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ImportError("No module named 'pynvml'"), "pynvml_missing"),
        (OSError("libnvidia-ml.so.1: cannot open shared object file"), "library_missing"),
    ],
)
def test_missing_library_gives_the_plain_message(
    monkeypatch: pytest.MonkeyPatch, error: Exception, reason: str
) -> None:
    def import_pynvml() -> object:
        raise error

    monkeypatch.setattr(nvml_module, "_import_pynvml", import_pynvml)

    with pytest.raises(DeviceUnavailableError, match=re.escape(REASONS[reason])) as excinfo:
        Nvml().list_gpus()
    assert str(error) in str(excinfo.value)
    assert excinfo.value.__cause__ is error
    assert excinfo.value.reason == reason


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="an NVIDIA driver is installed"
)
def test_real_pynvml_without_a_driver_is_device_unavailable() -> None:
    with pytest.raises(DeviceUnavailableError, match=UNAVAILABLE) as excinfo:
        Nvml().list_gpus()
    assert type(excinfo.value.__cause__).__name__ == "NVMLError_LibraryNotFound"
    with pytest.raises(DeviceUnavailableError, match=UNAVAILABLE):
        nvml_module.list_gpus()  # the process-wide instance


def test_importing_autobatch_never_initialises_nvml() -> None:
    # torch itself imports pynvml (torch/cuda/__init__.py), so "pynvml in sys.modules" says
    # nothing about autobatch: count nvmlInit calls on the real module instead.
    code = """
import sys
import pynvml
calls = []
pynvml.nvmlInit = lambda *args: calls.append("nvmlInit")
pynvml.nvmlInitWithFlags = lambda *args: calls.append("nvmlInitWithFlags")
import autobatch, autobatch.device, autobatch.device._nvml, autobatch.device._cuda
autobatch.device._nvml.default_nvml()
print(calls, autobatch.device._nvml.default_nvml()._lib)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "[] None"


def test_nvml_is_the_only_module_importing_pynvml() -> None:
    importers = sorted(
        str(path.relative_to(REPO_ROOT))
        for path in (REPO_ROOT / "autobatch").rglob("*.py")
        if re.search(r"^\s*(import pynvml|from pynvml import)", path.read_text(), re.MULTILINE)
    )
    assert importers == ["autobatch/device/_nvml.py"]


# --- initialisation -------------------------------------------------------------------------


def test_init_runs_once_across_many_calls() -> None:
    fake = FakePynvml(three_gpus())
    nvml = Nvml(fake, environ={})
    assert fake.num_init_calls == 0  # constructing initialises nothing

    for _ in range(5):
        nvml.list_gpus()
        nvml.driver_version()
        nvml.gpu_for_cuda_index(1)
    assert fake.num_init_calls == 1


def test_init_runs_once_across_threads() -> None:
    fake = FakePynvml(three_gpus(), init_delay_s=0.05)
    nvml = Nvml(fake, environ={})
    num_threads = 16
    barrier = threading.Barrier(num_threads)
    results: list[int] = []

    def worker() -> None:
        barrier.wait()
        results.append(len(nvml.list_gpus()))

    threads = [threading.Thread(target=worker) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert fake.num_init_calls == 1
    assert results == [3] * num_threads


def test_failed_init_is_retried_on_the_next_query() -> None:
    fake = FakePynvml(three_gpus(), init_errors=[ERROR_CLASSES["NVMLError_DriverNotLoaded"]()])
    nvml = Nvml(fake, environ={})

    with pytest.raises(DeviceUnavailableError, match="kernel driver is not loaded"):
        nvml.list_gpus()
    assert len(nvml.list_gpus()) == 3
    assert fake.num_init_calls == 2


# --- driver version --------------------------------------------------------------------------


@pytest.mark.parametrize("reported", ["550.54.15", b"550.54.15"])
def test_driver_version(reported: str | bytes) -> None:
    assert Nvml(FakePynvml([], driver_version=reported)).driver_version() == "550.54.15"


# --- CUDA capacity arithmetic (autobatch.device._cuda) ---------------------------------------


@pytest.mark.parametrize(
    ("total", "free", "reserved", "fraction", "expected"),
    [
        # another process holds 30 GiB of 80: start from the 50 GiB free, never from the total
        (
            80 * GiB,
            50 * GiB,
            0,
            1.0,
            Capacity(
                total_memory_bytes=80 * GiB, capacity_bytes=50 * GiB, foreign_memory_bytes=30 * GiB
            ),
        ),
        # torch already reserved 10 GiB: the driver counts it used, but it is ours to reuse
        (
            80 * GiB,
            40 * GiB,
            10 * GiB,
            1.0,
            Capacity(
                total_memory_bytes=80 * GiB, capacity_bytes=50 * GiB, foreign_memory_bytes=30 * GiB
            ),
        ),
        # the idle field case: only the driver's reserve is foreign
        (
            80 * GiB,
            80 * GiB - 912 * MiB,
            0,
            1.0,
            Capacity(
                total_memory_bytes=80 * GiB,
                capacity_bytes=80 * GiB - 912 * MiB,
                foreign_memory_bytes=912 * MiB,
            ),
        ),
        # set_per_process_memory_fraction(0.5) caps what the allocator may reserve
        (
            80 * GiB,
            79 * GiB,
            0,
            0.5,
            Capacity(
                total_memory_bytes=80 * GiB, capacity_bytes=40 * GiB, foreign_memory_bytes=1 * GiB
            ),
        ),
        (
            80 * GiB,
            60 * GiB,
            10 * GiB,
            0.25,
            Capacity(
                total_memory_bytes=80 * GiB, capacity_bytes=20 * GiB, foreign_memory_bytes=10 * GiB
            ),
        ),
        # a fraction above what is free does not raise the capacity
        (
            80 * GiB,
            20 * GiB,
            0,
            0.5,
            Capacity(
                total_memory_bytes=80 * GiB, capacity_bytes=20 * GiB, foreign_memory_bytes=60 * GiB
            ),
        ),
        # a MIG 1g.10gb slice reports its own memory
        (
            10 * GiB - 256 * MiB,
            9 * GiB,
            0,
            1.0,
            Capacity(
                total_memory_bytes=10 * GiB - 256 * MiB,
                capacity_bytes=9 * GiB,
                foreign_memory_bytes=768 * MiB,
            ),
        ),
        # snapshots taken a moment apart can disagree: clamp, never exceed the total
        (
            24 * GiB,
            20 * GiB,
            6 * GiB,
            1.0,
            Capacity(total_memory_bytes=24 * GiB, capacity_bytes=24 * GiB, foreign_memory_bytes=0),
        ),
    ],
    ids=[
        "foreign-30GiB",
        "torch-reserved",
        "idle-field-case",
        "fraction-half",
        "fraction-quarter",
        "fraction-above-free",
        "mig-slice",
        "racy-snapshot",
    ],
)
def test_usable_capacity(
    total: int, free: int, reserved: int, fraction: float, expected: Capacity
) -> None:
    capacity = usable_capacity(
        total_memory_bytes=total,
        free_memory_bytes=free,
        torch_reserved_bytes=reserved,
        memory_fraction=fraction,
    )
    assert capacity == expected


def test_cuda_device_without_cuda_is_device_unavailable() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(
        DeviceUnavailableError, match=r"CUDA is not available to torch .*device='cpu' or 'sim:SIZE'"
    ):
        CudaDevice(cuda_index=0)


def test_a_cuda_device_on_a_mig_instance_is_named_with_its_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a probe records as the profile's device_name, with torch's CUDA answering as on a
    # MIG container (torch reports the instance's UUID) and NVML faked.
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real card answers")
    properties = type("Props", (), {"uuid": "MIG-bbbb"})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    nvml = Nvml(FakePynvml(mig_machine()), environ={"NVIDIA_VISIBLE_DEVICES": "MIG-bbbb"})

    device = CudaDevice(cuda_index=0, nvml=nvml)
    assert device.name == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert nvml.gpu_for_uuid("MIG-bbbb").mig_profile == "1g.10gb"


def test_nvidia_visible_devices_as_a_mounted_device_list(tmp_path: Path) -> None:
    # The device plugin's volume-mounts strategy: the variable names a directory of devices.
    (tmp_path / "GPU-cccc-3333").touch()
    nvml = Nvml(FakePynvml(three_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": str(tmp_path)})
    assert [(g.uuid, g.cuda_index) for g in nvml.list_gpus() if g.given] == [("GPU-cccc-3333", 0)]
    missing = Nvml(FakePynvml(three_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": "/nonexistent"})
    assert not any(g.given for g in missing.list_gpus())
    # The note names the directory the pod was told to read, not the empty list it became.
    _, resolved = missing.visible()
    assert "NVIDIA_VISIBLE_DEVICES='/nonexistent' (the device plugin's volume-mounts" in (
        resolved.note
    )
    assert "cannot be read" in resolved.note and "NVIDIA_VISIBLE_DEVICES=''" not in resolved.note
    (tmp_path / "empty").mkdir()
    empty = Nvml(
        FakePynvml(three_gpus()), environ={"NVIDIA_VISIBLE_DEVICES": str(tmp_path / "empty")}
    )
    assert empty.visible()[1].note.endswith(
        "directory) lists no device: this container was given no GPU"
    )
