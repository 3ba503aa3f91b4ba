"""Guard rails on the public API."""

from __future__ import annotations

import subprocess
import sys

import autobatch


def test_all_is_sorted_and_complete() -> None:
    assert autobatch.__all__ == sorted(autobatch.__all__)
    public = {name for name in vars(autobatch) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(autobatch, name)).__name__ == "module"}
    assert public - modules - {"annotations"} == set(autobatch.__all__)


def test_import_does_not_initialise_nvml_or_cuda() -> None:
    code = (
        "import autobatch, torch, sys;"
        "print(torch.cuda.is_initialized(), 'autobatch.device.nvml' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
