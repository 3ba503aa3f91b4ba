"""The memory a job really has: the combination rule as a table, each reader against a
fake (an environment mapping, a cgroup file tree, a fake pynvml and ``mem_get_info``), and the
devices and plans built on them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import autobatch
import autobatch.device._cpu as cpu_module
import autobatch.device._cuda as cuda_module
from autobatch.device import (
    BudgetReading,
    CpuDevice,
    CudaDevice,
    MemoryBudget,
    SimulatedDevice,
    check_gpu_fraction,
    combine_budget,
    resolve_device,
    vgpu_limit_reading,
)
from autobatch.device._budget import SHARING_TOLERANCE, parse_memory_limit
from autobatch.device._cgroup import cgroup_reading
from autobatch.device._nvml import Nvml
from autobatch.errors import ConfigError
from autobatch.planning import PlanRequest, given_budget, plan_request
from autobatch.profile import MemoryModel, Profile, Trial
from tests.helpers.fake_pynvml import FakeGpu, FakePynvml, GiB, MiB


def r(
    source: Any, total_gib: float, available_gib: float | None = None, **kw: Any
) -> BudgetReading:
    available = total_gib if available_gib is None else available_gib
    free = kw.pop("free_gib", None)
    return BudgetReading(
        source=source,
        total_bytes=round(total_gib * GiB),
        available_bytes=round(available * GiB),
        free_bytes=None if free is None else round(free * GiB),
        **kw,
    )


# --- the rule, as a table --------------------------------------------------------------------

RULE = {
    # name: (readings, budget GiB, deciding source, sharing mode)
    "one card, alone": ([r("nvml", 10, 9.9, free_gib=9.9)], 9.9, "nvml", "none"),
    "HAMi: the runtime sees 3 of 10 GiB": (
        [r("nvml", 10, 9.9, free_gib=9.9), r("cuda_runtime", 3, 2.9, free_gib=2.9)],
        2.9,
        "cuda_runtime",
        "virtualised",
    ),
    "a vGPU limit variable": (
        [
            r("nvml", 10, 10, free_gib=10),
            r("cuda_runtime", 10, 10, free_gib=10),
            r("vgpu_limit", 1),
        ],
        1,
        "vgpu_limit",
        "virtualised",
    ),
    "a declared half of a 24 GB card": (
        [r("nvml", 24, 23.5, free_gib=23.5), r("gpu_fraction", 12)],
        12,
        "gpu_fraction",
        "fractional",
    ),
    "a per-process memory fraction": (
        [r("cuda_runtime", 16, 16, free_gib=16), r("memory_fraction", 4)],
        4,
        "memory_fraction",
        "fractional",
    ),
    "others hold 30 of 80 GB": ([r("nvml", 80, 50, free_gib=50)], 50, "nvml", "shared"),
    "3% apart is no sharing": (
        [r("nvml", 80, 79, free_gib=79), r("cuda_runtime", 77.6, 77.6, free_gib=77.6)],
        77.6,
        "cuda_runtime",
        "none",
    ),
    "a container allowed 8 of a 32 GiB host": (
        [r("host", 32, 24, free_gib=24), r("cgroup", 8, 6, free_gib=6)],
        6,
        "cgroup",
        "container_limited",
    ),
    "a host that is merely busy": ([r("host", 32, 20, free_gib=20)], 20, "host", "none"),
    "four time-sliced replicas": (
        [r("node_labels", 80), r("time_slicing", 20)],
        20,
        "time_slicing",
        "time_sliced",
    ),
    "a tie goes to the first read": (
        [r("nvml", 10, 10, free_gib=10), r("cuda_runtime", 10, 10, free_gib=10)],
        10,
        "nvml",
        "none",
    ),
    "a shared card decides over a looser fraction": (
        [r("nvml", 80, 50, free_gib=50), r("gpu_fraction", 72)],
        50,
        "nvml",
        "shared",
    ),
    "a fraction decides on a card others use": (
        [r("nvml", 80, 70, free_gib=70), r("gpu_fraction", 40)],
        40,
        "gpu_fraction",
        "fractional",
    ),
}


@pytest.mark.parametrize("case", sorted(RULE))
def test_the_budget_is_the_smallest_source_and_names_it(case: str) -> None:
    readings, budget_gib, decider, mode = RULE[case]

    budget = combine_budget(readings)

    assert budget.budget_bytes == round(budget_gib * GiB)
    assert budget.deciding_source == decider
    assert budget.sharing_mode == mode
    assert budget.readings == tuple(readings)  # every source, with its value, in order
    assert (mode == "none") == (not budget.warnings)
    if mode != "none":
        assert any(f"sharing mode {mode}" in w for w in budget.warnings)


def test_every_disagreement_warns_with_its_numbers() -> None:
    budget = combine_budget([r("nvml", 80, 70, free_gib=70), r("gpu_fraction", 40)])
    assert budget.warnings == (
        "nvml: 10.00 GiB of 80.00 GiB are held by other processes now: sharing mode shared",
        "gpu_fraction allows 40.00 GiB where nvml reports 80.00 GiB, more than 5% less: "
        "sharing mode fractional",
    )


def test_the_tolerance_edge() -> None:
    edge = 100 * (1 - SHARING_TOLERANCE)
    assert combine_budget([r("nvml", 100), r("vgpu_limit", edge)]).sharing_mode == "none"
    assert combine_budget([r("nvml", 100), r("vgpu_limit", edge - 0.01)]).sharing_mode == (
        "virtualised"
    )


def test_no_reading_is_no_budget() -> None:
    with pytest.raises(ConfigError, match="at least one reading"):
        combine_budget([])
    with pytest.raises(ConfigError, match="available_bytes .* exceeds total_bytes"):
        r("nvml", 1, 2)
    with pytest.raises(ConfigError, match="budget source 'nvlm'"):
        r("nvlm", 1)


@pytest.mark.parametrize(
    ("peak_gib", "fits_now", "trials"),
    [(9, True, 2), (11.3, True, 2), (11.5, True, 1), (7, True, 3), (23, False, 0)],
)
def test_a_plan_on_a_budget_says_whether_it_fits_now_and_how_many_fit_per_card(
    peak_gib: float, fits_now: bool, trials: int
) -> None:
    budget = combine_budget([r("nvml", 24, 22, free_gib=22), r("gpu_fraction", 12)])

    done = budget.for_peak(round(peak_gib * GiB), safety_margin=0.05)

    assert done.fits_now is fits_now
    # 24 GiB * 0.95 // peak: 22.8 / 9 = 2.5, / 11.3 = 2.02, / 11.5 = 1.98, / 7 = 3.3, / 23 = 0.99.
    assert done.trials_per_gpu == trials
    assert done.card_memory_bytes == 24 * GiB  # the fraction is one job's, not the card's
    assert any("free now" in w for w in done.warnings) == (not fits_now)


def test_a_host_budget_has_no_trials_per_gpu_and_an_unknown_peak_has_neither() -> None:
    host = combine_budget([r("host", 32, 24, free_gib=24)])
    assert host.for_peak(GiB, safety_margin=0.05).trials_per_gpu is None
    card = combine_budget([r("capacity_bytes", 24)])
    assert card.for_peak(None, safety_margin=0.05).fits_now is None
    assert card.for_peak(GiB, safety_margin=0.05).fits_now is None  # nothing read free memory


def test_a_budget_round_trips_and_rejects_what_it_is_not() -> None:
    budget = combine_budget(
        [r("nvml", 24, 22, free_gib=22), r("gpu_fraction", 12)], unseen_sources=["cuda_runtime"]
    ).for_peak(9 * GiB, safety_margin=0.05)
    assert MemoryBudget.from_dict(budget.to_dict()) == budget
    with pytest.raises(ConfigError, match="not a valid memory budget"):
        MemoryBudget.from_dict({"budget_bytes": 1})
    with pytest.raises(ConfigError, match="sharing_mode 'lent'"):
        MemoryBudget.from_dict({**budget.to_dict(), "sharing_mode": "lent"})
    with pytest.raises(ConfigError, match="deciding_source 'cgroup' is not among"):
        MemoryBudget.from_dict({**budget.to_dict(), "deciding_source": "cgroup"})


# --- readers: the environment, the declared fraction, the cgroup -----------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024m", GiB),
        ("1g", GiB),
        ("1G", GiB),
        ("1048576k", GiB),
        ("1073741824", GiB),
        (" 3g ", 3 * GiB),
        ("0", 0),
    ],
)
def test_vgpu_limits_are_read_in_hami_core_units(text: str, expected: int) -> None:
    assert parse_memory_limit("CUDA_DEVICE_MEMORY_LIMIT_0", text) == expected


@pytest.mark.parametrize("text", ["1.5g", "3GiB", "-1", "lots", "1t"])
def test_a_vgpu_limit_that_is_no_limit_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"CUDA_DEVICE_MEMORY_LIMIT_0='{text}' is not a memory"):
        vgpu_limit_reading({"CUDA_DEVICE_MEMORY_LIMIT_0": text}, 0)


def test_the_device_s_own_variable_wins_over_the_one_for_all() -> None:
    environ = {"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DEVICE_MEMORY_LIMIT": "2g"}

    first = vgpu_limit_reading(environ, 0)
    second = vgpu_limit_reading(environ, 1)

    assert first is not None and first.total_bytes == GiB
    assert first.detail == "CUDA_DEVICE_MEMORY_LIMIT_0='1024m'"
    assert second is not None and second.total_bytes == 2 * GiB
    # 0 is HAMi-core's "no limit of its own": the one for all applies.
    fallback = vgpu_limit_reading(
        {"CUDA_DEVICE_MEMORY_LIMIT_0": "0", "CUDA_DEVICE_MEMORY_LIMIT": "2g"}, 0
    )
    assert fallback is not None and fallback.total_bytes == 2 * GiB
    assert vgpu_limit_reading({"CUDA_DEVICE_MEMORY_LIMIT_1": "1g"}, 0) is None
    assert vgpu_limit_reading({}, 0) is None


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "0.5", math.nan, math.inf])
def test_a_gpu_fraction_outside_zero_to_one_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"gpu_fraction .* must be a number in \(0, 1\]"):
        check_gpu_fraction(value)
    assert check_gpu_fraction(1) == 1.0 and check_gpu_fraction(None) is None


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MEMINFO = f"MemTotal: {32 * GiB // 1024} kB\nMemFree: 1 kB\nMemAvailable: {24 * GiB // 1024} kB\n"


def cgroup_v2(root: Path, *, limit: str, current: int, inactive: int = 0) -> Path:
    return write(
        root,
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": f"{limit}\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.current": f"{current}\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.stat": f"anon 1\ninactive_file {inactive}\n",
        },
    )


def test_cgroup_v2_limit_less_the_working_set(tmp_path: Path) -> None:
    root = cgroup_v2(tmp_path, limit=str(8 * GiB), current=3 * GiB, inactive=GiB)

    reading = cgroup_reading(root)

    assert reading is not None
    assert (reading.total_bytes, reading.available_bytes) == (8 * GiB, 6 * GiB)
    assert "kubepods/pod1/ctr/memory.max" in reading.detail


def test_cgroup_v2_a_tighter_parent_or_memory_high_binds(tmp_path: Path) -> None:
    root = cgroup_v2(tmp_path, limit="max", current=GiB)
    assert cgroup_reading(root) is None  # "max": no limit anywhere
    write(root, {"sys/fs/cgroup/kubepods/pod1/memory.max": str(4 * GiB)})
    write(root, {"sys/fs/cgroup/kubepods/pod1/memory.current": str(3 * GiB)})
    parent = cgroup_reading(root)
    assert parent is not None and (parent.total_bytes, parent.available_bytes) == (4 * GiB, GiB)
    write(root, {"sys/fs/cgroup/kubepods/pod1/ctr/memory.high": str(GiB + GiB // 2)})
    high = cgroup_reading(root)
    assert high is not None and high.available_bytes == GiB // 2
    assert "memory.high" in high.detail


def test_cgroup_v2_in_its_own_namespace_is_read_at_the_mount(tmp_path: Path) -> None:
    # The process's path names the host's hierarchy, which the container does not mount.
    root = write(
        tmp_path,
        {
            "proc/self/cgroup": "0::/system.slice/docker-abc.scope\n",
            "sys/fs/cgroup/memory.max": str(2 * GiB),
            "sys/fs/cgroup/memory.current": "0",
        },
    )
    reading = cgroup_reading(root)
    assert reading is not None and reading.available_bytes == 2 * GiB


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(8 * GiB),
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": str(2 * GiB),
            "sys/fs/cgroup/memory/docker/abc/memory.stat": f"total_inactive_file {GiB}\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        },
    )
    reading = cgroup_reading(root)
    assert reading is not None and (reading.total_bytes, reading.available_bytes) == (
        8 * GiB,
        7 * GiB,
    )
    write(root, {"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_reading(root) is None


def test_no_proc_is_no_cgroup(tmp_path: Path) -> None:
    assert cgroup_reading(tmp_path) is None


# --- devices ---------------------------------------------------------------------------------


def test_the_cpu_in_a_container_budgets_its_cgroup_not_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The issue: device="cpu" budgeted the host's 24 GB available inside a container allowed 8 GiB.
    root = cgroup_v2(tmp_path, limit=str(8 * GiB), current=GiB)
    monkeypatch.setattr(cpu_module, "FS_ROOT", root)

    capacity = resolve_device("cpu").capacity()

    assert capacity.capacity_bytes == 7 * GiB
    assert capacity.total_memory_bytes == 32 * GiB
    assert capacity.budget is not None
    assert capacity.budget.deciding_source == "cgroup"
    assert capacity.budget.sharing_mode == "container_limited"
    assert [x.source for x in capacity.budget.readings] == ["host", "cgroup"]


def test_a_cpu_step_past_the_cgroup_budget_is_an_out_of_memory_error(tmp_path: Path) -> None:
    device = CpuDevice(root=cgroup_v2(tmp_path, limit=str(MiB), current=0))
    with pytest.raises(torch.OutOfMemoryError), device.measure([]):
        torch.ones(512 * 1024)  # 2 MiB > the 1 MiB the cgroup leaves
    with device.measure([]) as peak:
        torch.ones(128 * 1024)
    assert peak.allocated_bytes == 512 * 1024


def test_a_probe_on_the_cpu_of_a_small_container_plans_within_its_limit(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    sample = (torch.randn(1, 256), torch.randint(0, 8, (1,)))
    limit = 24 * MiB
    device = CpuDevice(root=cgroup_v2(tmp_path, limit=str(limit), current=0))

    result = autobatch.autotune(
        model,
        sample,
        effective_batch_size=4096,
        loss_fn=torch.nn.functional.cross_entropy,
        device=device,
        use_store=False,
    )

    assert result.budget is not None and result.budget.deciding_source == "cgroup"
    assert result.capacity_bytes == limit
    assert result.predicted_peak_memory_bytes is not None
    assert result.predicted_peak_memory_bytes <= limit
    assert result.budget.trials_per_gpu is None  # a host is no GPU


def test_a_declared_fraction_on_a_simulated_card_halves_the_plan() -> None:
    # The issue: two trials sharing a card each planned for the whole card.
    whole = SimulatedDevice(capacity_bytes=64 * MiB).capacity()
    half = resolve_device("sim:64MiB", gpu_fraction=0.5).capacity()

    assert whole.budget is not None and whole.budget.sharing_mode == "none"
    assert half.capacity_bytes == 32 * MiB
    assert half.budget is not None
    assert (half.budget.deciding_source, half.budget.sharing_mode) == ("gpu_fraction", "fractional")
    assert (
        resolve_device(SimulatedDevice(capacity_bytes=64 * MiB), gpu_fraction=0.25)
        .capacity()
        .capacity_bytes
        == 16 * MiB
    )


def test_a_gpu_fraction_is_refused_for_the_cpu_and_for_a_device_without_one() -> None:
    with pytest.raises(
        ConfigError, match="gpu_fraction 0.5 is a share of a GPU, but the device is the CPU"
    ):
        resolve_device("cpu", gpu_fraction=0.5)

    class Plain(SimulatedDevice):
        with_gpu_fraction = None  # type: ignore[assignment]

    with pytest.raises(ConfigError, match="has no with_gpu_fraction"):
        resolve_device(Plain(capacity_bytes=MiB), gpu_fraction=0.5)
    with pytest.raises(ConfigError, match=r"gpu_fraction 2 must be a number in \(0, 1\]"):
        resolve_device("sim:1GiB", gpu_fraction=2)


class FakeCuda:
    """torch.cuda's few functions CudaDevice reads, answering as a card behind a sharing layer."""

    def __init__(self, *, free: int, total: int, reserved: int = 0, fraction: float = 1.0) -> None:
        self.free, self.total, self.reserved, self.fraction = free, total, reserved, fraction

    def install(self, monkeypatch: pytest.MonkeyPatch, uuid: str) -> None:
        properties = type("Props", (), {"uuid": uuid})()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (self.free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: self.reserved)
        monkeypatch.setattr(
            torch.cuda, "get_per_process_memory_fraction", lambda index=None: self.fraction
        )


@pytest.fixture
def ten_gib_card(monkeypatch: pytest.MonkeyPatch) -> Nvml:
    """NVML sees a whole 10 GiB card; autobatch's default NVML is this fake."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real card answers")
    nvml = Nvml(
        FakePynvml([FakeGpu(uuid="GPU-1010", name="NVIDIA A10", total=10 * GiB, free=10 * GiB)]),
        environ={},
    )
    monkeypatch.setattr(cuda_module, "default_nvml", lambda: nvml)
    monkeypatch.delenv("CUDA_DEVICE_MEMORY_LIMIT_0", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MEMORY_LIMIT", raising=False)
    return nvml


def ten_gib_profile() -> Profile:
    """A step probed on the whole 10 GiB card: 1 GiB + 0.25 GiB a sample, 32 peaking at 9 GiB."""
    trials = tuple(
        Trial(micro_batch_size=n, fits=True, peak_reserved_bytes=GiB + n * GiB // 4)
        for n in (16, 32)
    )
    return Profile(
        max_micro_batch_size=32,
        recommended_micro_batch_size=32,
        safety_margin=0.05,
        method="probe",
        trials=(*trials, Trial(micro_batch_size=36, fits=False, oom=True)),
        num_steps=4,
        device_name="NVIDIA A10",
        device_type="cuda",
        total_memory_bytes=10 * GiB,
        capacity_bytes=10 * GiB,
        memory_model=MemoryModel(fixed_bytes=GiB, bytes_per_sample=GiB // 4),
    )


def test_a_sharing_layer_s_3_gib_decides_where_nvml_says_10(
    ten_gib_card: Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The issue: resolve_device("cuda:0") budgeted 10 GiB and planned 32 x 2 (9 GiB peak) where
    # torch.cuda.mem_get_info says 3 GiB.
    FakeCuda(free=3 * GiB, total=3 * GiB).install(monkeypatch, "GPU-1010")

    capacity = resolve_device("cuda:0").capacity()

    assert capacity.capacity_bytes == 3 * GiB
    assert capacity.total_memory_bytes == 10 * GiB  # the card, as NVML names it
    budget = capacity.budget
    assert budget is not None
    assert (budget.deciding_source, budget.sharing_mode) == ("cuda_runtime", "virtualised")
    assert [x.source for x in budget.readings] == ["nvml", "cuda_runtime"]
    assert [x.available_bytes for x in budget.readings] == [10 * GiB, 3 * GiB]

    wanted = PlanRequest(effective_batch_size=64, capacity_bytes=capacity.capacity_bytes)
    planned = plan_request(ten_gib_profile(), wanted, budget=budget)
    assert planned.predicted_peak_memory_bytes is not None
    assert planned.predicted_peak_memory_bytes <= 3 * GiB * 0.95
    assert planned.micro_batch_size < 32
    assert planned.budget is not None and planned.budget.trials_per_gpu == 1


def test_a_vgpu_limit_variable_decides(ten_gib_card: Nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(free=10 * GiB, total=10 * GiB).install(monkeypatch, "GPU-1010")
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "1024m")

    budget = CudaDevice(0).capacity().budget

    assert budget is not None and budget.budget_bytes == GiB
    assert (budget.deciding_source, budget.sharing_mode) == ("vgpu_limit", "virtualised")
    # An environment handed in is read instead of the process's.
    other = CudaDevice(0, environ={"CUDA_DEVICE_MEMORY_LIMIT": "2g"}).capacity()
    assert other.capacity_bytes == 2 * GiB


def test_the_per_process_fraction_and_a_declared_one_are_both_sources(
    ten_gib_card: Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeCuda(free=10 * GiB, total=10 * GiB, fraction=0.4).install(monkeypatch, "GPU-1010")

    alone = CudaDevice(0).capacity()
    declared = resolve_device("cuda:0", gpu_fraction=0.25).capacity()

    assert alone.capacity_bytes == 4 * GiB
    assert alone.budget is not None and alone.budget.deciding_source == "memory_fraction"
    assert declared.capacity_bytes == 10 * GiB // 4
    assert declared.budget is not None
    assert [x.source for x in declared.budget.readings] == [
        "nvml",
        "cuda_runtime",
        "memory_fraction",
        "gpu_fraction",
    ]
    assert (declared.budget.deciding_source, declared.budget.sharing_mode) == (
        "gpu_fraction",
        "fractional",
    )


def test_what_torch_already_reserved_counts_as_this_process_s(
    ten_gib_card: Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime's free memory leaves out this process's cache, which it may reuse.
    FakeCuda(free=2 * GiB, total=3 * GiB, reserved=GiB // 2).install(monkeypatch, "GPU-1010")
    assert CudaDevice(0).capacity().capacity_bytes == 2 * GiB + GiB // 2


def test_a_card_budget_from_a_given_size_and_fraction() -> None:
    budget = given_budget(24 * GiB, gpu_fraction=0.5)
    assert (budget.budget_bytes, budget.deciding_source, budget.sharing_mode) == (
        12 * GiB,
        "gpu_fraction",
        "fractional",
    )


def test_the_devices_page_lists_the_gpu_sources_in_the_order_they_are_read() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "devices.md"
    table = [
        line.split("|")[2].strip().strip("`")
        for line in page.read_text().split("On a GPU", 1)[1].split("On the CPU", 1)[0].splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    budget, _, _ = cuda_module.cuda_budget(
        nvml_memory=(10 * GiB, 10 * GiB),
        runtime_memory=(10 * GiB, 10 * GiB),
        torch_reserved_bytes=0,
        memory_fraction=0.5,
        gpu_fraction=0.5,
        environ={"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "2G"},
        cuda_index=0,
    )
    assert table == [reading.source for reading in budget.readings]
    assert table == [
        "nvml",
        "cuda_runtime",
        "vgpu_limit",
        "mps_limit",
        "memory_fraction",
        "gpu_fraction",
    ]


def test_without_the_cuda_runtime_nvml_alone_decides_and_the_budget_says_so(
    ten_gib_card: Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeCuda(free=10 * GiB, total=10 * GiB, fraction=0.5).install(monkeypatch, "GPU-1010")

    def no_context(index: object = None) -> tuple[int, int]:
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)

    capacity = CudaDevice(0).capacity()

    assert capacity.capacity_bytes == 5 * GiB  # the per-process fraction of NVML's total
    assert capacity.budget is not None
    assert capacity.budget.unseen_sources == ("cuda_runtime",)
    assert any("HAMi" in w for w in capacity.budget.warnings)
    with pytest.raises(autobatch.DeviceUnavailableError, match="neither from NVML nor"):
        cuda_module.cuda_budget(
            nvml_memory=None,
            runtime_memory=None,
            torch_reserved_bytes=0,
            memory_fraction=1.0,
            gpu_fraction=None,
            environ={},
            cuda_index=0,
        )
