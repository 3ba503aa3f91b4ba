"""What every launcher's reading shares: the layout, the fix it names, reading a count."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from autobatch.errors import ConfigError, Remedy

SlurmTaskRanks = Literal["one", "gpus"]
"""How many ranks a Slurm task is: ``"one"`` (the process Slurm started trains as one rank, the
reading inside a task), or ``"gpus"`` (each task starts one rank per GPU it holds, as a torchrun
per node does: the reading of a TaskProlog, before the task's command runs)."""


class _Count(str):
    """A count the user fills in, shown as its bare name in every spelling: ``world_size=N`` in
    Python, ``--world-size N`` on the command line."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


_RANKS = "the number of data-parallel ranks that train"
_FIX = Remedy(parameter="world_size", values=(_Count("N"),), purpose=_RANKS)
"""The fix for every launcher's disagreement: say how many ranks train."""
_UNSET_WORLD_SIZE = Remedy(purpose="an environment without WORLD_SIZE")


def _world_size_is(ranks: int, why: str) -> Remedy:
    """The fix naming one reading's count, e.g. ``world_size=16 (if mpiexec started the ranks)``."""
    return Remedy(parameter="world_size", values=(ranks,), purpose=why)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LauncherLayout:
    """The ranks a launcher started, as its environment says."""

    world_size: int
    """Ranks in the job (>= 1)."""
    nodes: int | None
    """Nodes (hosts, pods) the ranks run on; None when the launcher does not say."""
    ranks_per_node: int | None
    """Ranks on this node; None when the launcher does not say."""
    rank: int | None
    """This process's rank; None where the process is not itself a rank (a TaskProlog, or a
    pod's entry process before torchrun starts the ranks)."""
    local_rank: int | None
    """This process's rank on its node; None as for ``rank``."""
    source: str
    """The launcher and the variables read, e.g. ``"torchrun (WORLD_SIZE=16, RANK=3,
    LOCAL_RANK=3, LOCAL_WORLD_SIZE=8, GROUP_WORLD_SIZE=2)"``."""


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 1) -> int | None:
    """``environ[name]`` as an int >= ``minimum``; None when unset or blank.

    Raises:
        ConfigError: set to something else.
    """
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(
            f"{name} {raw!r} in the environment must be an int >= {minimum}",
            remedies=[Remedy(purpose=f"an environment without {name}"), _FIX],
        )
    return value


def _said(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{name}={environ[name]}" for name in names if environ.get(name, "").strip())


def _inside(environ: Mapping[str, str]) -> str:
    """Where an inner launcher runs, for the source: a Slurm job or a Kubeflow pod."""
    if "SLURM_JOB_ID" in environ:
        return f" in Slurm job {environ['SLURM_JOB_ID']}"
    if "PET_NNODES" in environ or "PET_NPROC_PER_NODE" in environ:
        return " in a Kubeflow pod"
    return ""


_TORCH_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
