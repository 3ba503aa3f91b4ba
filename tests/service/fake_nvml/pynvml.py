"""``pynvml`` for a real ``autobatch serve`` under test: ``tests.helpers.fake_pynvml``, steered by a
JSON file while the server runs.

Put this directory first on ``PYTHONPATH`` (the repository root after it) and name the control
file in ``AUTOBATCH_FAKE_NVML``::

    {"gpus": [{"uuid": "GPU-...", "name": "NVIDIA A100", "total": 85899345920, "free": ...}],
     "memory_delay_s": {"GPU-...": 6.0},           # that card's memory query hangs this long
     "memory_error": {"GPU-...": "NVMLError_GpuIsLost"}}

The file is read again at each memory query, so a test can hang, lose and recover a card
without restarting the server. Importing this module replaces itself in ``sys.modules`` with the
fake, as ``import pynvml`` expects a module-like object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.helpers.fake_pynvml import ERROR_CLASSES, FakeGpu, FakePynvml

_CONTROL = Path(os.environ["AUTOBATCH_FAKE_NVML"])


class SteeredPynvml(FakePynvml):
    """A :class:`FakePynvml` whose cards hang or fail as the control file says right now."""

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        control = json.loads(_CONTROL.read_text())
        handle.memory_delay_s = float(control.get("memory_delay_s", {}).get(handle.uuid, 0.0))
        error = control.get("memory_error", {}).get(handle.uuid)
        handle.memory_v2_error = handle.memory_v1_error = ERROR_CLASSES[error] if error else None
        return super().nvmlDeviceGetMemoryInfo(handle, version)


sys.modules[__name__] = SteeredPynvml(  # type: ignore[assignment]
    [FakeGpu(**gpu) for gpu in json.loads(_CONTROL.read_text())["gpus"]]
)
