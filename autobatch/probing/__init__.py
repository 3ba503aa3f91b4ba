"""Probing: the largest micro-batch whose whole training step fits, in few real trials.

``probe`` runs the search over real trials (``trials``, steered by the pure ``search``), after an
estimate on fake tensors (``estimate``); ``step`` and ``batch`` say how a sample becomes a step;
``snapshot`` leaves no trace; ``identity`` is what a profile is stored under; ``conditions``
reads the conditions a step runs under from the live process. This face is what
other layers and the benchmarks import (the benchmarks run peers over the same step, and drive
the pure search, ``next_micro_batch_size`` over ``Point`` outcomes, without a device).

Example::

    from autobatch.probing import BatchSource, TrainingStep

    step = TrainingStep(model, optimizer, loss_fn=loss_fn)
    step.run(BatchSource.from_sample(sample).make(8))
"""

from __future__ import annotations

from autobatch.probing.batch import BatchSource, batch_tensors
from autobatch.probing.conditions import read_conditions
from autobatch.probing.estimator import FakeStep, estimate
from autobatch.probing.prober import probe
from autobatch.probing.search import Point, bracket, next_micro_batch_size, trial_budget
from autobatch.probing.snapshot import resident_tensors
from autobatch.probing.step import LossFn, TrainingStep, TrainStep
from autobatch.probing.worst_case import WorstCaseSample, worst_case_sample

__all__ = [
    "BatchSource",
    "FakeStep",
    "LossFn",
    "Point",
    "TrainStep",
    "TrainingStep",
    "WorstCaseSample",
    "batch_tensors",
    "bracket",
    "estimate",
    "next_micro_batch_size",
    "probe",
    "read_conditions",
    "resident_tensors",
    "trial_budget",
    "worst_case_sample",
]
