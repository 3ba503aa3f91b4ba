"""The command line: exit codes and output on good and bad input; NVML and devices faked."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import autobatch
import autobatch.device
import autobatch.device._resolve as device_resolve
from autobatch.cli import main
from autobatch.device import Capacity
from autobatch.device import _nvml as nvml
from autobatch.device._nvml import Nvml
from autobatch.errors import ConfigError, DeviceUnavailableError
from autobatch.store import ProfileStore
from tests.helpers.fake_pynvml import ERROR_CLASSES, FakeGpu, FakePynvml, GiB


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_field_case_64_over_24(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64"
    )
    assert code == 0
    assert "micro_batch_size             16" in out
    assert "gradient_accumulation_steps  4" in out


def test_plan_world_size_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "plan",
        "--max-micro-batch-size",
        "24",
        "--effective-batch-size",
        "64",
        "--world-size",
        "1,2,3",
        "--json",
    )
    assert code == 0
    rows = json.loads(out)
    assert [r["world_size"] for r in rows] == [1, 2, 3]
    assert rows[1]["plan"]["micro_batch_sizes"] == [16, 16]
    assert rows[2]["plan"] is None and "multiple" in rows[2]["reason"]


def test_inexact_plan_names_the_real_cause(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        *["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "97"],
        *["--world-size", "4", "--allow-inexact"],
    )
    assert code == 0
    assert "effective_batch_size         96" in out
    assert (
        "note: effective_batch_size 97 is not a multiple of world_size 4; planned the nearest, 96"
        in out
    )
    assert "accumulation steps" not in out  # not the internal cap on steps


def test_plan_configs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "plan",
        "--max-micro-batch-size",
        "24",
        "--effective-batch-size",
        "64",
        "--world-size",
        "2",
        "--format",
        "deepspeed",
    )
    assert code == 0
    assert json.loads(out) == {  # DeepSpeed computes train_batch_size = 16 x 2 x its world
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "plan",
                "--max-micro-batch-size",
                "24",
                "--effective-batch-size",
                "100",
                "--world-size",
                "3",
            ],
            "use --effective-batch-size 99 or 102, or --allow-inexact (plan the nearest)",
        ),
        (
            ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "97"]
            + ["--world-size", "4"],
            "argument --effective-batch-size: 97 is not a multiple of --world-size 4; use "
            "--effective-batch-size 96 or 100, or --allow-inexact (plan the nearest)",
        ),
        (
            ["estimate", "gpt2-tiny", "--seq-len", "32", "--capacity", "1KiB"],
            "use a larger device, --amp bf16 (reduced precision), or a smaller model",
        ),
        (
            ["plan", "--max-micro-batch-size", "0", "--effective-batch-size", "8"],
            "must be at least 1",
        ),
        (["plan", "--effective-batch-size", "8"], "one of the arguments"),
        (["estimate", "gpt2-tiny", "--capacity", "lots"], "memory size"),
        (["estimate", "no-such-model", "--capacity", "1GiB"], "neither built in"),
        (["tune", "gpt2-tiny", "--effective-batch-size", "8", "--device", "tpu"], "not understood"),
    ],
)
def test_bad_input_exits_non_zero_with_one_clear_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code != 0
    assert message in err
    assert "Traceback" not in err
    assert "allow_inexact" not in err and "amp_dtype" not in err  # flags, not Python arguments


@pytest.mark.parametrize(
    ("argv", "missing", "hint"),
    [
        (["serve"], "service.__main__", "pip install -e '.[service]' in the autobatch checkout"),
        (
            ["estimate", "gpt2-tiny", "--capacity", "1GiB"],
            "transformers",
            "pip install -e '.[models]' in the autobatch checkout",
        ),
    ],
)
def test_missing_extras_name_the_install_from_the_checkout(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    missing: str,
    hint: str,
) -> None:
    # The name autobatch on PyPI is another project: `pip install 'autobatch[service]'` would
    # install that one.
    monkeypatch.setitem(sys.modules, missing, None)  # the import raises ImportError
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert hint in err
    assert "autobatch[" not in err


def test_devices_without_a_driver_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_driver = FakePynvml([], init_errors=[ERROR_CLASSES["NVMLError_DriverNotLoaded"]()])
    monkeypatch.setattr(nvml, "default_nvml", lambda: Nvml(no_driver, environ={}))
    code, out, err = run(capsys, "devices")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "NVML is not available" in err
    assert "Traceback" not in err


def test_devices_on_a_machine_without_the_nvidia_library_points_to_cpu_and_sim(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_library = FakePynvml([], init_errors=[ERROR_CLASSES["NVMLError_LibraryNotFound"]()])
    monkeypatch.setattr(nvml, "default_nvml", lambda: Nvml(no_library, environ={}))
    code, out, err = run(capsys, "devices")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "libnvidia-ml.so.1 was not found" in err
    # devices has no --device: the remedy reads in plain words, naming no flag it lacks
    assert err.rstrip().endswith("use device cpu or sim:SIZE (on a machine without a GPU)")


def test_devices_lists_what_nvml_reports(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = FakePynvml(
        [FakeGpu(uuid="GPU-aaaa", name="NVIDIA A100-SXM4-80GB", total=80 * GiB, free=79 * GiB)]
    )
    monkeypatch.setattr(nvml, "default_nvml", lambda: Nvml(gpus, environ={}))
    code, out, _ = run(capsys, "devices")
    assert code == 0
    assert out.startswith("nvml 0  cuda 0  NVIDIA A100-SXM4-80GB  GPU-aaaa  total 80.00 GiB")
    code, out, _ = run(capsys, "devices", "--json")
    (listed,) = json.loads(out)
    assert listed["uuid"] == "GPU-aaaa" and listed["memory"]["free_memory_bytes"] == 79 * GiB


def test_devices_lists_a_mig_instance_whose_parent_refuses_queries(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import autobatch.device._nvml as nvml_module
    from tests.helpers.fake_pynvml import ERROR_CLASSES, FakeGpu, FakePynvml, GiB

    no_permission = ERROR_CLASSES["NVMLError_NoPermission"]
    instance = FakeGpu(
        uuid="MIG-aaaa", name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", total=40 * GiB, free=39 * GiB
    )
    parent = FakeGpu(
        uuid="GPU-mig0",
        name="NVIDIA A100-SXM4-80GB",
        total=80 * GiB,
        free=40 * GiB,
        mig_mode=1,
        mig_slots={0: instance},
        memory_v2_error=no_permission,
        memory_v1_error=no_permission,
    )
    fake_nvml = nvml_module.Nvml(
        FakePynvml([parent]), environ={"NVIDIA_VISIBLE_DEVICES": "MIG-aaaa"}
    )
    monkeypatch.setattr(nvml_module, "_default_nvml", fake_nvml)

    code, out, _err = run(capsys, "devices")
    assert code == 0
    parent_line, instance_line = out.splitlines()
    assert "total unknown" in parent_line and "(unknown: no_permission)" in parent_line
    assert "(not given to this container)" in parent_line
    assert (
        "cuda 0  MIG NVIDIA A100-SXM4-80GB MIG 3g.40gb  MIG-aaaa  total 40.00 GiB" in instance_line
    )


def test_closed_stdout_exits_quietly() -> None:
    # `autobatch ... | head`: the reader has gone before anything is written.
    argv = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64"]
    with subprocess.Popen(
        [sys.executable, "-m", "autobatch", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as child:
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()
        stderr = child.stderr.read().decode()
        code = child.wait(timeout=120)
    assert stderr == ""
    assert code == 141  # as a Unix tool killed by SIGPIPE


def test_estimate_prints_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "estimate", "gpt2-tiny", "--seq-len", "32", "--capacity", "64MiB", "--json"
    )
    assert code == 0
    profile = json.loads(out)
    assert profile["method"] == "estimate"
    assert profile["capacity_bytes"] == 64 * 2**20
    assert profile["max_micro_batch_size"] >= 1


def test_tune_json_parses_and_second_run_is_cached(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [
        "--store",
        str(tmp_path / "s.sqlite3"),
        "tune",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--device",
        "sim:48MiB",
        "--effective-batch-size",
        "64",
        "--json",
    ]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    data = json.loads(out)
    plan, profile = data["plan"], data["profile"]
    assert plan["effective_batch_size"] == 64 and plan["source"] == "measured"
    assert sum(plan["micro_batch_sizes"]) == 64
    assert plan["micro_batch_size"] <= profile["recommended_micro_batch_size"]
    assert err == ""  # quiet under --json
    code, out, _ = run(capsys, *argv)
    assert code == 0 and json.loads(out)["plan"]["source"] == "cached"
    code, out, _ = run(capsys, "--store", str(tmp_path / "s.sqlite3"), "profiles", "list")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == [
        "ID",
        "CREATED",
        "(UTC)",
        "DEVICE",
        "MEASURED",
        "MAX",
        "RECOMMENDED",
        "MODE",
        "OPTIMIZER",
        "CHECKPOINTING",
        "INPUT",
        "FINGERPRINT",
        "MODEL",
    ]
    assert row.index("sim") == header.index("DEVICE")  # columns line up under the header
    # The model by the name the command line was given; its fingerprint's start beside it.
    assert row[header.index("MODEL") :] == "gpt2-tiny"
    assert row[header.index("FINGERPRINT") :].split()[0] == profile["model_fingerprint"][:12]
    assert row.index("train") == header.index("MODE")  # an eval profile reads "eval"
    assert row.index("input_ids 32, labels 32") == header.index("INPUT")


def test_profiles_list_tells_an_eval_profile_from_a_training_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `plan --profile ID` refuses an eval profile: the list must say which is which.
    from autobatch.store._store import ProfileStore
    from tests.planning.test_prediction import issue_profile

    store = tmp_path / "s.sqlite3"
    with ProfileStore(store) as opened:
        ids = {opened.put(issue_profile()): "train", opened.put(issue_profile(mode="eval")): "eval"}
    code, out, _ = run(capsys, "--store", str(store), "profiles", "list")
    assert code == 0
    header, *rows = out.splitlines()
    column = header.index("MODE")
    assert {row.split()[0]: row[column:].split()[0] for row in rows} == ids


@pytest.mark.parametrize("cuda", [False, True])
def test_tune_defaults_to_the_natural_device_and_says_which(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cuda: bool
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # the same answer on a GPU host
    code, out, err = run(
        capsys,
        *["tune", "examples.models:tiny_mlp", "--input-shape", "32", "--no-store", "--json"],
        *["--max-micro-batch-size", "8", "--effective-batch-size", "64"],
    )
    if cuda:  # chosen, then refused: the (faked) driver lists no device
        assert err.startswith("autobatch: tuning on cuda:0 (CUDA is available; --device chooses)")
        assert code == 1 and "CUDA device 0 does not exist" in err
    else:
        assert err == "autobatch: tuning on cpu (no CUDA; --device chooses)\n"
        assert code == 0 and json.loads(out)["profile"]["device_type"] == "cpu"


TINY = ["tests.service.models:tiny_mlp", "--input-shape", "32"]


def test_tune_no_store_neither_reads_nor_writes_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = tmp_path / "s.sqlite3"
    argv = ["--store", str(store), "tune", *TINY, "--device", "sim:4MiB"]
    argv += ["--effective-batch-size", "64", "--json"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert json.loads(out)["plan"]["source"] == "measured"
    code, out, err = run(capsys, *argv, "--no-store")
    assert code == 0, err
    assert json.loads(out)["plan"]["source"] == "measured"  # the stored profile was not read
    code, out, _ = run(capsys, "--store", str(store), "profiles", "list", "--json")
    assert len(json.loads(out)) == 1  # and the second was not written


class OtherCard:
    """A device whose tensors live on ``meta``, not the CPU: stands for ``cuda:0`` here. The
    road checks that model and sample are on it before asking it anything; then it stops."""

    name = "other-card"
    type = "sim"
    torch_device = torch.device("meta")
    driver_version = ""

    def capacity(self) -> Capacity:
        raise DeviceUnavailableError("reached other-card with the model and sample on it")

    def measure(self, resident: Any) -> Any:
        raise AssertionError("not reached")

    def release(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def clock(self) -> float:
        return 0.0

    @property
    def steps_scale_with_size(self) -> bool:
        return False


def test_tune_puts_model_and_sample_on_a_device_other_than_the_cpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``autobatch tune ... --device cuda:0`` moves the loaded model to the device it resolves."""
    asked: list[str] = []

    def resolve(spec: Any, **kwargs: Any) -> Any:
        if isinstance(spec, OtherCard):  # the library passes a resolved device through
            return spec
        asked.append(spec)
        return OtherCard()

    monkeypatch.setattr(autobatch.device, "resolve_device", resolve)
    code, _, err = run(
        capsys, "tune", *TINY, "--device", "cuda:0", "--effective-batch-size", "8", "--no-store"
    )
    assert asked == ["cuda:0"]
    assert code == 1
    assert "reached other-card with the model and sample on it" in err, err


def test_profiles_show_and_delete_unknown(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = str(tmp_path / "s.sqlite3")
    ProfileStore(store).close()  # an empty store: reading a missing one is another error
    code, _, err = run(capsys, "--store", store, "profiles", "show", "nope")
    assert code == 1 and "nope" in err
    code, _, err = run(capsys, "--store", store, "profiles", "delete", "nope")
    assert code == 1 and "no profile 'nope'" in err


def test_store_that_is_not_a_database_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"not a database at all" * 100)
    code, _, err = run(capsys, "--store", str(bad), "profiles", "list")
    assert code == 1 and str(bad) in err
    assert bad.read_bytes() == b"not a database at all" * 100


def test_plan_takes_the_data_parallel_size_and_prints_the_formula(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys,
        *["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64"],
        *["--data-parallel-size", "2"],
    )
    assert code == 0
    assert "world_size                   2" in out
    formula = (
        "note: effective_batch_size 64 = 16 (micro_batch_size) x 2 (gradient_accumulation_steps)"
        " x 2 (data-parallel ranks)"
    )
    assert out.count(formula) == 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--world-size", "2", "--data-parallel-size", "4"],
        ["--data-parallel-size", "2", "--data-parallel-size", "4"],
    ],
)
def test_the_data_parallel_size_under_two_names_must_agree(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    argv = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64", *flags]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size and --data-parallel-size are one setting; give it once" in err
    # The same value under both names is one setting given twice: accepted.
    same = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64"]
    assert main([*same, "--world-size", "2", "--data-parallel-size", "2"]) == 0


def test_model_spec_to_moves_the_model_in_place_and_every_sample_tensor() -> None:
    from autobatch.errors import ConfigError
    from autobatch.models._zoo import ModelSpec

    model = torch.nn.Linear(4, 2)
    sample = {"x": torch.randn(1, 4), "meta": {"ids": torch.zeros(1, dtype=torch.long)}, "n": 3}
    spec = ModelSpec(name="m", model=model, sample=sample).to(torch.device("meta"))
    assert spec.model is model and model.weight.device.type == "meta"
    assert spec.sample["x"].device.type == spec.sample["meta"]["ids"].device.type == "meta"
    assert spec.sample["n"] == 3 and sample["x"].device.type == "cpu"  # the caller's sample stays
    with pytest.raises(ConfigError, match="a callable sample cannot be moved"):
        ModelSpec(name="f", model=model, sample=lambda n: torch.randn(n, 4)).to(torch.device("cpu"))
    # CPU to meta replaces the parameters (CPU to CUDA keeps them): an optimizer over the old
    # ones would step tensors the probe never uses.
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="replaced the parameters its optimizer holds"):
        ModelSpec(name="o", model=model, sample=sample, optimizer=optimizer).to(
            torch.device("meta")
        )


@pytest.mark.parametrize(
    ("limit", "says_limit"),
    [("8", True), ("100000000", False)],  # 64 MiB holds ~20k rows of tiny_mlp, not 1e8
)
def test_estimate_says_when_the_max_is_the_limit_not_the_memory(
    capsys: pytest.CaptureFixture[str], limit: str, says_limit: bool
) -> None:
    code, out, _ = run(
        capsys,
        *["estimate", "examples.models:tiny_mlp", "--input-shape", "32", "--capacity", "64MiB"],
        *["--max-micro-batch-size", limit],
    )
    assert code == 0
    assert ("(predicted maximum 8: a fake-tensor estimate, no real step ran)" in out) is says_limit
    # Never a measurement: the per-sample bytes are predicted, with how far they may be off.
    assert re.search(r"^predicted peak   [\d.]+ \w+ \+ [\d.]+ \w+ per sample$", out, re.M)
    assert "not measured" in out and "off by more than 25%" in out
    assert "max micro-batch" not in out and "peak memory" not in out
    assert ("is the --max-micro-batch-size limit, not the memory's" in out) is says_limit


@pytest.mark.parametrize(
    ("flags", "note"),
    [
        (["--max-micro-batch-size", "4"], "note: 4 is the --max-micro-batch-size limit, not the"),
        ([], "note: 8 is the largest a plan for this effective batch size uses, not the memory's"),
    ],
)
def test_tune_says_when_the_max_is_a_limit_not_the_memory(
    capsys: pytest.CaptureFixture[str], flags: list[str], note: str
) -> None:
    # 4 MiB holds hundreds of tiny_mlp rows: the search stops at the flag or at E / W = 8
    code, out, _ = run(
        capsys,
        *["tune", *TINY, "--no-store", "--device", "sim:4MiB", "--effective-batch-size", "8"],
        *flags,
    )
    assert code == 0
    assert note in out


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out == f"autobatch {autobatch.__version__}\n"


@pytest.mark.parametrize(
    ("shape", "cause"),
    [("3x224", "'3x224' is not a whole number"), ("3,0", "0 must be at least 1")],
)
def test_a_malformed_input_shape_is_explained_with_an_example(
    capsys: pytest.CaptureFixture[str], shape: str, cause: str
) -> None:
    code, _, err = run(capsys, "estimate", *TINY[:1], "--input-shape", shape, "--capacity", "1GiB")
    assert code == 2
    assert f"'{shape}' is not a shape ({cause}): write one sample's sizes" in err
    assert "e.g. 3,224,224" in err


def test_plan_refuses_an_eval_profile_in_words_it_can_follow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autobatch.store._store import ProfileStore
    from tests.planning.test_planner import plan
    from tests.planning.test_prediction import issue_profile

    store = tmp_path / "s.sqlite3"
    with ProfileStore(store) as opened:
        profile_id = opened.put(issue_profile(mode="eval"))
    code, _, err = run(
        capsys,
        "--store",
        str(store),
        "plan",
        "--profile",
        profile_id,
        "--effective-batch-size",
        "8",
    )
    assert code == 1
    # plan has no --eval: plain words
    assert "mode 'eval'" in err and "a run without eval (a training profile)" in err
    assert "eval=" not in err
    # The library words the same remedy by its Python argument.
    with pytest.raises(ConfigError, match=r"eval=False \(a training profile\)"):
        plan(issue_profile(mode="eval"), effective_batch_size=8)


def test_tune_text_shows_where_the_probe_s_time_went(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The suite times a named card's steps on a set clock (tests/conftest.py); a user's is the
    # wall clock, which this test is about.
    monkeypatch.setattr(device_resolve, "NAMED_SIM_STEP_SECONDS", None)
    argv = ["tune", *TINY, "--device", "sim:4MiB", "--no-store", "--effective-batch-size", "64"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("probe time"))
    # A card named by a string runs its steps on this CPU and times them by the wall clock:
    # the tiny model's steps cost milliseconds, less than the estimate would save.
    assert "(simulated clock)" not in line and "real trials" in line, line
    assert line.startswith("probe time       ") and " s: " in line, line


TORCHRUN = {
    "WORLD_SIZE": "4",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2",
}
"""torchrun's variables for rank 1 of 4 (2 nodes x 2), before any process group exists."""


def test_tune_under_torchrun_plans_for_the_launchers_ranks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    argv = ["tune", *TINY, "--device", "sim:4MiB", "--effective-batch-size", "64", "--no-store"]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["world_size"] == 4  # read from the launcher, as autotune(world_size=None) does
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * 4 == 64
    code, out, err = run(capsys, *argv, "--json", "--world-size", "1")
    assert code == 0, err
    assert json.loads(out)["plan"]["world_size"] == 1  # a given size wins


@pytest.mark.parametrize(
    ("given", "why"),
    [("4,4", "'4,4' lists 4 more than once; give each once"),
     ("1,,2", "'1,,2' has an empty item; e.g. 1,2,4,8"),
     (",", "',' holds no number; e.g. 1,2,4,8")],
)  # fmt: skip
def test_a_world_size_list_is_read_as_the_http_field_is(
    capsys: pytest.CaptureFixture[str], given: str, why: str
) -> None:
    # A fresh user's finding: 4,4 printed two identical rows and 1,,2 dropped the empty item,
    # where POST /v1/plan's world_sizes refuses both.
    code, out, err = run(
        capsys, "plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64",
        "--world-size", given,
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert f"autobatch plan: error: argument --world-size/--data-parallel-size: {why}\n" in err
