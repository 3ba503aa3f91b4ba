"""An MPS client's memory limit joins the budget: ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
in each of its forms decides a budget that NVML alone put at the whole card."""

from __future__ import annotations

import pytest
import torch

import autobatch.device._cuda as cuda_module
from autobatch.device import CudaDevice, budget_from_labels, budget_from_nvml
from autobatch.device._mps import MPS_LIMIT_VARIABLE, mps_limit_reading, parse_mps_limits
from autobatch.device._nvml import Nvml
from autobatch.errors import ConfigError, DeviceUnavailableError
from tests.device.test_budget import FakeCuda
from tests.helpers.fake_pynvml import FakeGpu, FakePynvml, GiB, MiB

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
TOTAL = 46068 * MiB  # an L40S as NVML reports it
FREE = 45466 * MiB


@pytest.fixture
def l40s(monkeypatch: pytest.MonkeyPatch) -> Nvml:
    """NVML and the CUDA runtime both see the whole card; no limit variable is set."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real card answers")
    nvml = Nvml(
        FakePynvml([FakeGpu(uuid=UUID, name="NVIDIA L40S", total=TOTAL, free=FREE)]), environ={}
    )
    monkeypatch.setattr(cuda_module, "default_nvml", lambda: nvml)
    for name in (MPS_LIMIT_VARIABLE, "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    FakeCuda(free=FREE, total=TOTAL).install(monkeypatch, UUID)
    return nvml


@pytest.mark.parametrize(
    "value",
    [
        "0=4606M",
        "0=4606MB",
        "4606M",
        "0=4606m,1=8G",
        "1=8G, 0=4606mb",
        "GPU-8932f937=4606M",
        UUID + "=4606M",
    ],
)
def test_the_mps_limit_decides_the_budget_in_every_form(
    l40s: Nvml, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # The issue: budget 45,466 MiB from NVML, sharing "none", against a 4,606 MiB limit.
    monkeypatch.setenv(MPS_LIMIT_VARIABLE, value)

    capacity = CudaDevice(0).capacity()

    budget = capacity.budget
    assert budget is not None
    assert capacity.capacity_bytes == budget.budget_bytes == 4606 * MiB
    assert (budget.deciding_source, budget.sharing_mode) == ("mps_limit", "mps")
    assert [r.source for r in budget.readings] == ["nvml", "cuda_runtime", "mps_limit"]
    assert budget.card_memory_bytes == TOTAL  # one client's share is not the card
    (warning,) = budget.warnings
    assert warning.startswith("mps_limit allows 4.50 GiB where nvml reports 44.99 GiB")
    assert f"{MPS_LIMIT_VARIABLE}=" in warning and warning.endswith("sharing mode mps")


def test_a_list_limits_each_device_by_its_own_entry() -> None:
    environ = {MPS_LIMIT_VARIABLE: "0=4G,1=8G"}
    first = mps_limit_reading(environ, cuda_index=0)
    second = mps_limit_reading(environ, cuda_index=1)
    assert first is not None and first.available_bytes == 4 * GiB
    assert second is not None and second.available_bytes == 8 * GiB
    assert mps_limit_reading(environ, cuda_index=2) is None  # not named: no limit
    assert mps_limit_reading({}, cuda_index=0) is None
    assert mps_limit_reading({MPS_LIMIT_VARIABLE: " "}, cuda_index=0) is None
    by_uuid = {MPS_LIMIT_VARIABLE: "GPU-8932=2G"}
    assert mps_limit_reading(by_uuid, cuda_index=0) is None  # the UUID is not known
    reading = mps_limit_reading(by_uuid, cuda_index=0, uuid=UUID)
    assert reading is not None and reading.available_bytes == 2 * GiB
    assert mps_limit_reading(by_uuid, cuda_index=0, uuid="GPU-1111") is None
    assert parse_mps_limits("4606M") == {"*": 4606 * MiB}


@pytest.mark.parametrize(
    "value",
    [
        "4606",
        "4.5G",
        "0=",
        "=4G",
        "0=4GiB",
        "0=0M",
        "0:4G",
        "0=4G;1=8G",
        "0=4G,0=8G",
        "-1=4G",
        "lots",
    ],
)
def test_a_value_that_is_no_mps_limit_is_refused_naming_the_variable_and_the_forms(
    value: str,
) -> None:
    with pytest.raises(ConfigError) as caught:
        mps_limit_reading({MPS_LIMIT_VARIABLE: value}, cuda_index=0)
    message = str(caught.value)
    assert message.startswith(f"{MPS_LIMIT_VARIABLE}={value!r} is not an MPS memory limit")
    assert "'<device>=<limit>[,<device>=<limit>...]'" in message
    assert "e.g. '0=4606M', '4606MB' or '0=4G,1=8G'" in message


def test_a_bad_value_on_the_device_is_a_config_error(
    l40s: Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MPS_LIMIT_VARIABLE, "4606")
    with pytest.raises(ConfigError, match=f"{MPS_LIMIT_VARIABLE}='4606' is not an MPS"):
        CudaDevice(0).capacity()


def test_the_service_reads_it_for_a_local_card_and_names_the_device_plugin_s_mps_share() -> None:
    gpu = Nvml(
        FakePynvml([FakeGpu(uuid=UUID, name="NVIDIA L40S", total=TOTAL, free=FREE)]), environ={}
    ).list_gpus()[0]

    card = budget_from_nvml(
        gpu, memory="total", gpu_fraction=None, environ={MPS_LIMIT_VARIABLE: "0=4606MB"}
    )

    assert (card.budget.budget_bytes, card.budget.deciding_source) == (4606 * MiB, "mps_limit")
    assert card.budget.sharing_mode == "mps"
    with pytest.raises(DeviceUnavailableError, match="is not an MPS memory limit"):
        budget_from_nvml(gpu, memory="total", gpu_fraction=None, environ={MPS_LIMIT_VARIABLE: "x"})
    # The device plugin's MPS strategy gives each client 1/replicas of the card as its limit.
    shared = budget_from_labels(
        {
            "nvidia.com/gpu.memory": "24576",
            "nvidia.com/gpu.replicas": "4",
            "nvidia.com/gpu.sharing-strategy": "mps",
        },
        mig_profile=None,
        gpu_fraction=None,
        gpus=[],
    )
    assert (shared.budget.budget_bytes, shared.budget.deciding_source) == (6 * GiB, "mps_limit")
    assert shared.budget.sharing_mode == "mps"
    assert "(mps, each client limited to its share" in shared.budget.readings[1].detail
