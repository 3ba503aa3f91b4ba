"""Guard rails on the public API."""

from __future__ import annotations

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
    # ``import autobatch.probing.probe as m`` is the module (patching ``m.x`` patches the
    # module), and importing the submodules does not hide the functions of the package.
    out = run_python(
        "import autobatch.probing.probe as p, autobatch.probing.estimate as e,"
        " autobatch.tuning as t;"
        "import autobatch;"
        "print(*(type(m).__name__ for m in (p, e, t)),"
        "*(type(getattr(autobatch, n)).__name__ for n in ('probe', 'estimate', 'autotune')))"
    )
    assert out.split() == ["module"] * 3 + ["function"] * 3


def test_submodules_are_attributes_after_a_plain_import() -> None:
    out = run_python(
        "import autobatch, sys;"
        "print(autobatch.planning.__name__, autobatch.profiles.__name__,"
        " 'torch' in sys.modules,"
        "autobatch.probing.__name__)"
    )
    assert out.split() == [
        "autobatch.planning",
        "autobatch.profiles",
        "False",
        "autobatch.probing",
    ]


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
    assert 'Revealed type is "autobatch.planning.planner.Plan"' in done.stdout


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
        "from autobatch import plan, Profile, ProfileStore, deepspeed_config, parse_bytes;"
        "import autobatch.client.http, service.main;"
        "service.main.create_app;"
        "print('torch' in sys.modules)"
    )
    assert out.split() == ["False"]


def test_import_does_not_initialise_nvml_or_cuda() -> None:
    out = run_python(
        "import autobatch, torch, sys; autobatch.autotune;"
        "print(torch.cuda.is_initialized(), 'autobatch.device.nvml' in sys.modules)"
    )
    assert out.split() == ["False", "False"]
