"""Training: the Accumulator (gradient accumulation with an exact gradient), run-time OOM
splitting, and the agreements that keep DDP ranks in step.

- ``accumulator``: :class:`Accumulator`, which groups micro-batches into windows;
- ``window``: one :class:`Window` (its micro-steps and optimizer step) and its :class:`StepStats`;
- ``micro_step``: :class:`MicroStep` and the ``WindowState`` a window shares with the modules
  below (the seam: they read a window only through it);
- ``oom_split``: ``Window.run`` splitting a micro-batch that runs out of memory
  (:class:`SplitEvent`), cutting it with ``pieces``;
- ``limit_agreement``: under DDP, the ranks agree on the piece-size limit once per micro-step;
- ``window_agreement``: under DDP, the window agreement carries one rank's error to the others,
  and stops every rank together where uneven shards run out (:class:`UnevenStop`);
- ``counting``: how many items a micro-batch counts;
- ``sampler``: :class:`MixedBatchSampler`, each rank's share of every global batch (ranks whose
  micro-batches differ: a mixed plan).

Example::

    from autobatch.training import Accumulator

    acc = Accumulator(model, optimizer, gradient_accumulation_steps=4)
"""

from __future__ import annotations

from autobatch.training._accumulator import Accumulator
from autobatch.training._micro_step import MicroStep
from autobatch.training._oom_split import OnOom, SplitEvent
from autobatch.training._sampler import MixedBatchSampler, rank_shares
from autobatch.training._window import StepStats, Window
from autobatch.training._window_agreement import UnevenStop

__all__ = [
    "Accumulator",
    "MicroStep",
    "MixedBatchSampler",
    "OnOom",
    "SplitEvent",
    "StepStats",
    "UnevenStop",
    "Window",
    "rank_shares",
]
