"""How a gloo worker process of the tests ends: without C++ static destructors.

torch 2.13's gloo can leave joinable threads behind; when the process then exits normally the C++
runtime aborts it ("terminate called without an active exception", SIGABRT), after the worker
has written everything the test checks. CI saw it in about 1 run in 20 of each multi-process
test on 2 cores, so a suite with a dozen such tests failed more often than not.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch.distributed as dist


def leave_gloo_worker() -> None:
    """Meet the other ranks (when the group still works), destroy the group, and leave the
    process at once with exit status 0. Call it only after the worker's results are written and
    only on the path where the worker succeeded: an exception must still fail the process."""
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):  # a group another rank aborted: none to meet
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
