"""How a gloo worker process of the tests starts (:func:`join_gloo_group`) and ends: without
C++ static destructors (:func:`leave_gloo_worker`).

torch 2.13's gloo can leave joinable threads behind; when the process then exits normally the C++
runtime aborts it ("terminate called without an active exception", SIGABRT), after the worker
has written everything the test checks. It is intermittent per process, so a suite with a dozen
multi-process tests would fail often if any of them exited normally.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch.distributed as dist


def join_gloo_group(rank: int, world_size: int, rendezvous: str, *, timeout_s: float) -> None:
    """Initialise the default gloo group through the file ``rendezvous``, with a collective
    timeout of ``timeout_s`` seconds: short, so a rank left waiting fails its test instead of
    blocking the suite."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


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
