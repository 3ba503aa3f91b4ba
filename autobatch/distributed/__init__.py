"""Distributed: the model's parallel layout (``layout``), the probe's consensus across ranks
(``consensus``), the deadline of the ranks' agreements (``deadline``), the data-parallel gradient
reduction a loop skips between micro-steps (``sync``), and the fake backend a probe's steps run
their collectives on (``fake_backend``).

Example::

    from autobatch.distributed import ProcessGroupConsensus

    profile = autobatch.probe(model, sample, consensus=ProcessGroupConsensus())
"""

from __future__ import annotations

from autobatch.distributed._consensus import (
    Consensus,
    LocalConsensus,
    ProcessGroupConsensus,
    process_group_consensus,
)
from autobatch.distributed._deadline import AgreementDeadline, Agreements, Default, resolve_deadline
from autobatch.distributed._fake_backend import process_groups_faked, reset_fsdp2, reshard_fsdp2
from autobatch.distributed._layout import (
    FSDP2_LAYOUT,
    FSDP2_TP_LAYOUT,
    TENSOR_PARALLEL_LAYOUT,
    collective_layout,
    resolve_world_size,
    world_size_of,
)
from autobatch.distributed._sync import DataParallel, data_parallel, refuse_engine

__all__ = [
    "FSDP2_LAYOUT",
    "FSDP2_TP_LAYOUT",
    "TENSOR_PARALLEL_LAYOUT",
    "AgreementDeadline",
    "Agreements",
    "Consensus",
    "DataParallel",
    "Default",
    "LocalConsensus",
    "ProcessGroupConsensus",
    "collective_layout",
    "data_parallel",
    "process_group_consensus",
    "process_groups_faked",
    "refuse_engine",
    "reset_fsdp2",
    "reshard_fsdp2",
    "resolve_deadline",
    "resolve_world_size",
    "world_size_of",
]
