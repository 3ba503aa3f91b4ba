"""The host memory a container may use: its cgroup's memory limit (v2 and v1) and usage.

Read from a file tree whose root is a parameter (``/`` on a real host; tests point it at a
temporary directory): ``<root>/proc/self/cgroup`` names this process's cgroup, whose limits are
under ``<root>/sys/fs/cgroup``. The limit is the tightest of the process's cgroup and every
ancestor the container can see (a limit on a parent cgroup binds too). No torch.

- v2 (one unified hierarchy, the ``0::/path`` line): ``memory.max`` (``max`` is no limit) and
  ``memory.high`` (the kernel throttles and reclaims above it), usage ``memory.current``.
- v1 (the ``memory`` controller's line): ``memory.limit_in_bytes`` (a value near 2**63 is no
  limit), usage ``memory.usage_in_bytes``.

Usage counts page cache the kernel reclaims before it kills anything, so what remains is the
limit minus the working set (usage minus inactive file pages, ``memory.stat``), as kubelet and
cAdvisor count it.

Example::

    reading = cgroup_reading(Path("/"))
    None if reading is None else reading.available_bytes
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autobatch.device._budget import BudgetReading

__all__ = ["cgroup_reading"]

_NO_LIMIT_V1 = 2**60
"""cgroup v1 writes "no limit" as LONG_MAX rounded down to a page (9223372036854771712); any
value this large is no limit."""


def cgroup_reading(root: Path) -> BudgetReading | None:
    """This process's cgroup memory limit as a ``cgroup`` reading (``total_bytes`` the limit,
    ``available_bytes`` and ``free_bytes`` the limit minus the working set); None when no cgroup
    the process can see sets a limit, or the files cannot be read (not Linux, no /proc)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: BudgetReading | None = None
    for line in lines:
        _, controllers, path = _fields(line)
        if controllers == "":  # v2: the unified hierarchy
            found = _tightest(root / "sys/fs/cgroup", path, _v2_level)
        elif "memory" in controllers.split(","):
            found = _tightest(root / "sys/fs/cgroup/memory", path, _v1_level)
        else:
            continue
        if found is not None and (best is None or found.available_bytes < best.available_bytes):
            best = found
    return best


def _fields(line: str) -> tuple[str, str, str]:
    hierarchy, _, rest = line.partition(":")
    controllers, _, path = rest.partition(":")
    return hierarchy, controllers, path


_Level = tuple[int, int, str]
"""A cgroup's limit, its working set (bytes) and how they were read."""


def _tightest(
    mount: Path, path: str, level: Callable[[Path], _Level | None]
) -> BudgetReading | None:
    """The limit of ``path`` (relative to the hierarchy's ``mount``) or an ancestor that leaves
    the least; a path the container cannot see (its cgroup namespace hides the host's path) is
    read at the mount, which is then the container's own cgroup."""
    here = mount / path.strip("/")
    if not here.is_dir():
        here = mount
    chain = [here, *(parent for parent in here.parents if parent.is_relative_to(mount))]
    best: BudgetReading | None = None
    for directory in chain:
        found = level(directory)
        if found is None:
            continue
        limit, working_set, detail = found
        left = max(0, limit - working_set)
        if best is None or left < best.available_bytes:
            best = BudgetReading(
                source="cgroup",
                total_bytes=limit,
                available_bytes=min(left, limit),
                free_bytes=min(left, limit),
                detail=f"{directory / detail}: {limit} bytes, working set {working_set} bytes",
            )
    return best


def _v2_level(directory: Path) -> _Level | None:
    limits = [
        (value, name)
        for name in ("memory.max", "memory.high")
        if (value := _number(directory / name)) is not None
    ]
    if not limits:
        return None
    limit, name = min(limits)
    usage = _number(directory / "memory.current") or 0
    inactive = _stat(directory / "memory.stat", "inactive_file")
    return limit, max(0, usage - inactive), name


def _v1_level(directory: Path) -> _Level | None:
    limit = _number(directory / "memory.limit_in_bytes")
    if limit is None or limit >= _NO_LIMIT_V1:
        return None
    usage = _number(directory / "memory.usage_in_bytes") or 0
    inactive = _stat(directory / "memory.stat", "total_inactive_file")
    return limit, max(0, usage - inactive), "memory.limit_in_bytes"


def _number(path: Path) -> int | None:
    """The file's integer; None when it is missing, unreadable, ``max`` or not a number."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    """One counter of a ``memory.stat`` file; 0 when it is missing."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
