"""Guard rails on the public API."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import autobatch

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout


def test_all_is_sorted_and_names_every_export() -> None:
    assert autobatch.__all__ == sorted(autobatch.__all__)
    assert set(autobatch.__all__) == set(autobatch._EXPORTS)
    for name in autobatch.__all__:
        value = getattr(autobatch, name)
        assert not isinstance(value, types.ModuleType), name
        if isinstance(value, type) or callable(value) and hasattr(value, "__code__"):
            assert value.__name__ == name
    assert set(autobatch.__all__) <= set(dir(autobatch))


def test_modules_are_named_apart_from_their_functions() -> None:
    # ``import autobatch.probing._prober as m`` is the module (patching ``m.x`` patches the
    # module), and importing the submodules does not hide the functions of the package.
    out = run_python(
        "import autobatch.probing._prober as p, autobatch.probing._estimator as e,"
        " autobatch.tuning as t;"
        "import autobatch;"
        "print(*(type(m).__name__ for m in (p, e, t)),"
        "*(type(getattr(autobatch, n)).__name__ for n in ('probe', 'estimate', 'autotune')))"
    )
    assert out.split() == ["module"] * 3 + ["function"] * 3


PUBLIC = [
    "Accumulator",
    "AutobatchError",
    "ConfigError",
    "DeviceUnavailableError",
    "DistributedError",
    "DoesNotFitError",
    "EstimateUnavailableError",
    "NoFeasiblePlanError",
    "Plan",
    "PlanRequest",
    "ProcessGroupConsensus",
    "Profile",
    "ProfileStore",
    "ServiceError",
    "SimulatedDevice",
    "SplitEvent",
    "StepFailedError",
    "StoreError",
    "TuneRequest",
    "autotune",
    "estimate",
    "format_bytes",
    "parse_bytes",
    "plan",
    "plan_world_sizes",
    "probe",
    "resolve_device",
    "split_recorder",
    "tune",
    "worst_case_sample",
]

# What the service, the benchmarks, the examples and the docs may import: the package, its
# documented namespaces, and each layer's face. Modules inside a layer are private.
FACES = {
    "autobatch",
    "autobatch.cli",
    "autobatch.client",
    "autobatch.conditions",
    "autobatch.device",
    "autobatch.distributed",
    "autobatch.errors",
    "autobatch.extras",
    "autobatch.integrations",
    "autobatch.integrations.accelerate",
    "autobatch.integrations.hf",
    "autobatch.integrations.lightning",
    "autobatch.margin",
    "autobatch.models",
    "autobatch.planning",
    "autobatch.probing",
    "autobatch.profile",
    "autobatch.store",
    "autobatch.training",
    "autobatch.tuning",
    "autobatch.units",
}


def test_the_public_surface_is_pinned_and_small() -> None:
    assert autobatch.__all__ == PUBLIC
    assert len(PUBLIC) <= 30


def test_no_submodule_is_a_package_attribute_by_fallback() -> None:
    # A name outside __all__ is an AttributeError, not a silently imported submodule.
    done = subprocess.run(
        [sys.executable, "-c", "import autobatch; autobatch.planning"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert "module 'autobatch' has no attribute 'planning'" in done.stderr


@pytest.mark.parametrize("face", sorted(FACES - {"autobatch"}))
def test_every_face_exports_sorted_names_that_resolve(face: str) -> None:
    module = importlib.import_module(face)
    names = list(module.__all__)
    assert names == sorted(names, key=lambda n: (not n.isupper(), n)) or names == sorted(names)
    for name in names:
        assert getattr(module, name) is not None, (face, name)


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "autobatch"}


def test_service_bench_and_examples_import_only_public_faces() -> None:
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for folder in ("service", "bench", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for module in _imported_modules(path)
        if module not in FACES
    }
    assert not offenders, sorted(offenders)


def test_type_checkers_see_the_exports_and_flag_misspellings(tmp_path: Path) -> None:
    # The lazy __getattr__ is hidden from type checkers; without that, mypy would take every
    # unknown name as Any and let typos through.
    (tmp_path / "user.py").write_text(
        "import autobatch\n"
        "from autobatch import plan, Planner\n"
        "autobatch.plan_world_size\n"
        "reveal_type(autobatch.plan(8, effective_batch_size=16))\n"
    )
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = silent\nignore_missing_imports = True\n"
        "[mypy-torch.*,transformers.*,numpy.*,httpx.*,tqdm.*]\nfollow_imports = skip\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "user.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert 'Module "autobatch" has no attribute "Planner"' in done.stdout, done.stdout
    assert 'no attribute "plan_world_size"' in done.stdout
    assert 'Revealed type is "autobatch.planning._plan.Plan"' in done.stdout


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Planner'"):
        _ = autobatch.Planner  # type: ignore[attr-defined]


def test_star_import_gives_every_export() -> None:
    out = run_python(
        "from autobatch import *; import autobatch;"
        "print(all(n in globals() for n in autobatch.__all__))"
    )
    assert out.split() == ["True"]


def test_planning_the_service_and_the_client_do_not_import_torch() -> None:
    # The service's process plans and stores; torch there would cost seconds at start and make
    # each full garbage collection walk torch's ~200,000 objects (p99 latency).
    out = run_python(
        "import sys, autobatch;"
        "from autobatch import plan, Profile, ProfileStore, parse_bytes;"
        "from autobatch.integrations import deepspeed_config;"
        "import autobatch.client, service.main;"
        "service.main.create_app;"
        "print('torch' in sys.modules)"
    )
    assert out.split() == ["False"]


def test_import_does_not_initialise_nvml_or_cuda() -> None:
    out = run_python(
        "import autobatch, torch, sys; autobatch.autotune;"
        "print(torch.cuda.is_initialized(), 'autobatch.device._nvml' in sys.modules)"
    )
    assert out.split() == ["False", "False"]
