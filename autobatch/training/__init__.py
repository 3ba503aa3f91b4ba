"""Training: the Accumulator (gradient accumulation with an exact gradient), run-time OOM
splitting (``oom_split``), and the window agreement that carries one rank's error to the others
(``window_agreement``).

Example::

    from autobatch.training import Accumulator

    acc = Accumulator(model, optimizer, gradient_accumulation_steps=4)
"""

from __future__ import annotations

from autobatch.training.accumulator import Accumulator, StepStats, Window
from autobatch.training.micro_step import MicroStep
from autobatch.training.oom_split import OnOom, SplitEvent

__all__ = ["Accumulator", "MicroStep", "OnOom", "SplitEvent", "StepStats", "Window"]
