"""The one road: a tuning request validated once -> store lookup -> estimate/probe -> plan.

:func:`autotune` (the Python API), the CLI's ``tune`` and the framework drop-ins build a
:class:`TuneRequest` and go through :func:`tune_request` (the plan and the profile); the
service's probe jobs call :func:`tune_profile` (they store a profile, and plan later). The store
is read and written only in :func:`find_profile`.

Example::

    plan = autobatch.autotune(model, sample, effective_batch_size=1024, device="sim:8GiB")
    plan.micro_batch_size, plan.gradient_accumulation_steps, plan.source
"""

from __future__ import annotations

from autobatch.tuning._cache import TunedProfile
from autobatch.tuning._checkpointing import CheckpointingOutcome, ModeRun
from autobatch.tuning._lookup import find_profile
from autobatch.tuning._report import report_data, report_html
from autobatch.tuning._request import BuildOptions, ProfileOptions, TuneOptions, TuneRequest
from autobatch.tuning._split_recording import split_recorder
from autobatch.tuning._tune import (
    Tuning,
    autotune,
    autotune_profile,
    largest_request,
    tune,
    tune_largest,
    tune_profile,
    tune_request,
)

__all__ = [
    "BuildOptions",
    "CheckpointingOutcome",
    "ModeRun",
    "ProfileOptions",
    "TuneOptions",
    "TuneRequest",
    "TunedProfile",
    "Tuning",
    "autotune",
    "autotune_profile",
    "find_profile",
    "largest_request",
    "report_data",
    "report_html",
    "split_recorder",
    "tune",
    "tune_largest",
    "tune_profile",
    "tune_request",
]
