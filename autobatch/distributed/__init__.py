"""Distributed: the model's parallel layout (``layout``), the probe's consensus across ranks
(``consensus``), the deadline of the ranks' agreements (``deadline``), the data-parallel gradient
reduction a loop skips between micro-steps (``sync``), and the fake backend a probe's steps run
their collectives on (``fake_backend``).

Example::

    from autobatch.distributed import ProcessGroupConsensus

    profile = autobatch.probe(model, sample, consensus=ProcessGroupConsensus())
"""

from __future__ import annotations

from autobatch.distributed.consensus import Consensus, LocalConsensus, ProcessGroupConsensus
from autobatch.distributed.deadline import AgreementDeadline
from autobatch.distributed.fake_backend import process_groups_faked
from autobatch.distributed.layout import collective_layout, data_parallel_size

__all__ = [
    "AgreementDeadline",
    "Consensus",
    "LocalConsensus",
    "ProcessGroupConsensus",
    "collective_layout",
    "data_parallel_size",
    "process_groups_faked",
]
