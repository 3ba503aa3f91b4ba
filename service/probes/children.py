"""Probe children that die with the server: no probe outlives the process that started it.

A probe run's child (``service.probes.runs``) calls :func:`die_with_parent` first thing. It then
leads its own process group, so the server kills the child and anything it started (compile workers,
say) at once with :func:`kill_group`, and a Ctrl-C at the server's terminal reaches the server
only, which then stops its children itself. And it gets SIGKILL the moment the server dies, even
by SIGKILL or the OOM killer, when nothing of the server's runs to clean up: Linux's parent-death
signal (``prctl(PR_SET_PDEATHSIG)``), elsewhere a thread that polls the parent's pid. A child
whose server died before it got there exits at once.

Linux sends the parent-death signal when the *thread* that started the child ends, not only the
process: ``service.probes.runs`` starts each child from the worker thread that waits for it, which
ends only after the child has.

Example::

    def child_main(parent_pid: int) -> None:
        die_with_parent(parent_pid)
        ...

    kill_group(process)          # in the server: the child and everything in its group
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from multiprocessing.process import BaseProcess

__all__ = ["die_with_parent", "kill_group"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_SECONDS = 0.5


def die_with_parent(parent_pid: int) -> None:
    """Lead a new process group, and die (SIGKILL) when ``parent_pid``, the server, dies.

    Call it first thing in the child; ``parent_pid`` is the server's ``os.getpid()``, passed in
    (``os.getppid()`` here would already be another process if the server died meanwhile).
    """
    with contextlib.suppress(OSError):  # already a group leader (or not allowed): carry on
        os.setpgid(0, 0)
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(
            target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True
        ).start()
    if os.getppid() != parent_pid:  # the server died before the signal was set
        _die()


def kill_group(process: BaseProcess) -> None:
    """SIGKILL ``process`` and, when it leads its own group (:func:`die_with_parent`), every
    process in that group; never the server's own group. A process already gone is no error."""
    pid = process.pid
    if pid is None:
        return
    try:
        leads_group = os.getpgid(pid) == pid
    except OSError:  # exited (a zombie's group is still readable, a reaped pid's is not)
        leads_group = False
    if leads_group and pid != os.getpgrp():
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
            return
    process.kill()


def _parent_death_signal(sig: signal.Signals) -> bool:
    """Set this process's parent-death signal; False where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_SECONDS)
    _die()


def _die() -> None:
    """SIGKILL this process's group if it leads one (it and whatever it started), else exit."""
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)
