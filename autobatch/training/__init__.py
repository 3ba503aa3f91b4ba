"""Training: the Accumulator (gradient accumulation with an exact gradient), run-time OOM
splitting, and the agreements that keep DDP ranks in step.

- ``accumulator``: :class:`Accumulator`, which groups micro-batches into windows;
- ``window``: one :class:`Window` (its micro-steps and optimizer step) and its :class:`StepStats`;
- ``micro_step``: :class:`MicroStep` and the ``WindowState`` a window shares with the modules
  below (the seam: they read a window only through it);
- ``oom_split``: ``Window.run`` splitting a micro-batch that runs out of memory
  (:class:`SplitEvent`), cutting it with ``pieces``;
- ``limit_agreement``: under DDP, the ranks agree on the piece-size limit once per micro-step;
- ``window_agreement``: under DDP, the window agreement carries one rank's error to the others;
- ``counting``: how many items a micro-batch counts;
- ``sampler``: :class:`MixedBatchSampler`, each rank's share of every global batch (ranks whose
  micro-batches differ: a mixed plan).

Example::

    from autobatch.training import Accumulator

    acc = Accumulator(model, optimizer, gradient_accumulation_steps=4)
"""

from __future__ import annotations

from autobatch.training.accumulator import Accumulator
from autobatch.training.micro_step import MicroStep
from autobatch.training.oom_split import OnOom, SplitEvent
from autobatch.training.sampler import MixedBatchSampler, rank_shares
from autobatch.training.window import StepStats, Window

__all__ = [
    "Accumulator",
    "MicroStep",
    "MixedBatchSampler",
    "OnOom",
    "SplitEvent",
    "StepStats",
    "Window",
    "rank_shares",
]
