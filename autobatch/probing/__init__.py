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

from autobatch.probing._batch import BatchSource, batch_tensors
from autobatch.probing._checkpointing import (
    CHECKPOINTING_MODES,
    CheckpointingMode,
    activation_checkpointing_applied,
    apply_activation_checkpointing,
    checkpointable_blocks,
    checkpointed_blocks,
    remove_activation_checkpointing,
)
from autobatch.probing._compiled import compiled_mode
from autobatch.probing._estimator import FakeStep, estimate
from autobatch.probing._identity import callable_identity
from autobatch.probing._live_conditions import (
    check_plan_here,
    live_world_size,
    process_conditions,
    read_conditions,
)
from autobatch.probing._options import (
    DEFAULT_SEARCH_LIMIT,
    OnStage,
    OnTrial,
    ProbeOptions,
    ProbeStage,
    StepSpec,
    check_search_arguments,
)
from autobatch.probing._placement import model_device
from autobatch.probing._prober import probe, run_confirmation, run_probe, run_timing
from autobatch.probing._search import Point, bracket, next_micro_batch_size, trial_budget
from autobatch.probing._snapshot import preserved_rng, resident_tensors
from autobatch.probing._step import LossFn, TrainingStep, TrainStep
from autobatch.probing._worst_case import WorstCaseSample, worst_case_sample

__all__ = [
    "CHECKPOINTING_MODES",
    "DEFAULT_SEARCH_LIMIT",
    "BatchSource",
    "CheckpointingMode",
    "FakeStep",
    "LossFn",
    "OnStage",
    "OnTrial",
    "Point",
    "ProbeOptions",
    "ProbeStage",
    "StepSpec",
    "TrainStep",
    "TrainingStep",
    "WorstCaseSample",
    "activation_checkpointing_applied",
    "apply_activation_checkpointing",
    "batch_tensors",
    "bracket",
    "callable_identity",
    "check_plan_here",
    "check_search_arguments",
    "checkpointable_blocks",
    "checkpointed_blocks",
    "compiled_mode",
    "estimate",
    "live_world_size",
    "model_device",
    "next_micro_batch_size",
    "preserved_rng",
    "probe",
    "process_conditions",
    "read_conditions",
    "remove_activation_checkpointing",
    "resident_tensors",
    "run_confirmation",
    "run_probe",
    "run_timing",
    "trial_budget",
    "worst_case_sample",
]
