"""The README's training-loop snippet runs as printed: every name it uses, it defines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet(marker: str) -> str:
    """The first ```python block that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (block,) = [b for b in blocks if marker in b][:1]
    return str(block)


def test_accumulator_snippet_runs_and_steps_once_per_window() -> None:
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(_snippet("Accumulator("), str(README), "exec"), namespace)  # noqa: S102

    plan, stats, scheduler = namespace["plan"], namespace["stats"], namespace["scheduler"]
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (16, 4)
    assert stats.global_count == 64 and stats.num_micro_steps == 4  # the last window is whole
    assert scheduler.last_epoch == 640 // 64  # one scheduler step per window
