"""How the ranks of a data-parallel job agree during a probe: the :class:`Consensus` protocol,
:class:`LocalConsensus` (a single process) and :class:`ProcessGroupConsensus` (a torch.distributed
process group).

:class:`ProcessGroupConsensus` uses element-wise MIN all-reduces and broadcasts from rank 0 of small
int64 tensors (on the CPU for gloo, on the probed CUDA device for nccl). With it, every rank runs
the
same micro-batch sizes in the same order; a size fits only if it fits on every rank, so a smaller or
busier card lowers the plan for all; a non-OOM failure on one rank ends the probe on every rank
within the same collective (no rank is left waiting). Each agreement has a deadline
(:mod:`autobatch.distributed._deadline`): a rank that stops answering (hung inside a trial, say)
fails the others within a few step-times, naming it, not at the process group's timeout.

:func:`autobatch.autotune` uses it by itself when ``torch.distributed`` is initialised: rank 0
alone reads and writes the profile store, and every rank returns rank 0's profile, so every rank
gets the same Plan. (The Accumulator's window agreement, which carries one rank's error to the
others during training, is another mechanism: :mod:`autobatch.training._window_agreement`.)

Example::

    consensus = LocalConsensus()
    consensus.min_ints([3, 5])   # [3, 5]: one process, every value already agreed

    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    profile = autobatch.probe(model, sample, consensus=ProcessGroupConsensus())
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from autobatch.distributed._deadline import (
    AgreementDeadline,
    Agreements,
    Default,
    resolve_deadline,
)
from autobatch.distributed._fake_backend import groups_faked
from autobatch.errors import DistributedError

__all__ = [
    "Consensus",
    "LocalConsensus",
    "ProcessGroupConsensus",
    "consensus_device",
    "process_group_consensus",
]

T = TypeVar("T")


class Consensus(Protocol):
    """How the ranks of a data-parallel job agree during a probe.

    Every rank makes the same calls in the same order, with sequences of the same length.
    """

    @property
    def rank(self) -> int:
        """This process's rank, in ``[0, world_size)``."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over the ranks, on every rank."""
        ...

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank."""
        ...


class LocalConsensus:
    """The consensus of a single process: every value is already agreed, and this process is
    rank 0 (so the store lane of :mod:`autobatch.tuning._cache` is the same for one rank and
    many)."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def min_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def all_equal(self, value: str) -> bool:
        """True: one rank agrees with itself."""
        return True

    def on_rank_zero(self, work: Callable[[], T], doing: str) -> T:
        """``work()``: this process is rank 0."""
        return work()

    def on_every_rank(self, work: Callable[[], T], doing: str) -> list[T]:
        """``[work()]``: one rank."""
        return [work()]


class ProcessGroupConsensus:
    """Consensus between the ranks of a torch.distributed process group.

    Every rank must make the same calls in the same order (they are collectives).

    Args:
        group: the process group; None means the default (``WORLD``) group.
        device: the device this rank probes. Under nccl the agreement's small tensors go there
            (a CUDA device), not to the current CUDA device, which on a rank that never called
            ``torch.cuda.set_device`` is cuda:0, another rank's GPU. None: the current device.
        deadline: how long each agreement after the first waits for a peer
            (:class:`~autobatch.distributed._deadline.AgreementDeadline`; the default reads
            ``$AUTOBATCH_AGREEMENT_SECONDS``); None: the process group's own timeout.

    Raises:
        DistributedError: torch.distributed is not available or not initialised, the group
            is bound to another CUDA device than ``device`` (``init_process_group(device_id=)``),
            or the process groups are faked (inside a step a probe runs: no agreement could
            communicate).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        deadline: AgreementDeadline | Default | None = Default.DEADLINE,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "torch.distributed is not initialised; call torch.distributed.init_process_group "
                "first (torchrun sets the environment it reads)"
            )
        if groups_faked():
            raise DistributedError(
                "cannot probe under torch.distributed while every process group's collectives "
                "go to a fake backend (inside a train_step that a probe is running, or a "
                "process_groups_faked block): the ranks' agreement would communicate nothing, "
                "and each rank would get its own answer. Call autotune outside them"
            )
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        pg = group if group is not None else dist.group.WORLD
        self._device = consensus_device(
            str(dist.get_backend(group)),
            probed=device,
            bound=getattr(pg, "bound_device_id", None),
            current_cuda_index=torch.cuda.current_device,
        )
        self._agreements = Agreements(group, resolve_deadline(deadline))
        self._num_agreements = 0

    @property
    def device(self) -> torch.device:
        """Where the agreement's tensors live: the CPU for gloo, a CUDA device otherwise."""
        return self._device

    def __repr__(self) -> str:
        return (
            f"ProcessGroupConsensus(rank={self._rank}, world_size={self._world_size}, "
            f"device={self._device})"
        )

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world_size

    def _where(self) -> str:
        self._num_agreements += 1
        return (
            f"the probe's agreement number {self._num_agreements} (the ranks agree after each step)"
        )

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over the ranks (one all-reduce of ``len(values)`` int64s).

        Raises:
            DistributedError: a peer did not answer within the deadline (names it).
        """
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        self._agreements.all_reduce(tensor, dist.ReduceOp.MIN, where=self._where())
        return [int(value) for value in tensor.tolist()]

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank (one broadcast of ``len(values)`` int64s).

        Raises:
            DistributedError: a peer did not answer within the deadline (names it).
        """
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        self._agreements.broadcast(tensor, where=self._where())
        return [int(value) for value in tensor.tolist()]

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` (picklable), on every rank; the others' ``obj`` is ignored (two
        broadcasts: the pickle's length, then its bytes).

        Raises:
            DistributedError: a peer did not answer within the deadline (names it).
        """
        data = pickle.dumps(obj) if self._rank == 0 else b""
        (length,) = self.broadcast_ints([len(data)])
        buffer = torch.zeros(length, dtype=torch.uint8, device=self._device)
        if self._rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._agreements.broadcast(buffer, where=self._where())
        return cast(T, pickle.loads(buffer.cpu().numpy().tobytes()))

    def all_equal(self, value: str) -> bool:
        """True on every rank when every rank's ``value`` equals rank 0's."""
        first = self.broadcast_object(value)
        return self.min_ints([int(value == first)])[0] == 1

    def on_rank_zero(self, work: Callable[[], T], doing: str) -> T:
        """Run ``work`` on rank 0 only; its result (picklable) on every rank.

        Args:
            work: what rank 0 does (e.g. read the profile store).
            doing: what it is, for the other ranks' error message (e.g. "reading the store").

        Raises:
            DistributedError: on the other ranks, when ``work`` raised on rank 0 (which raises
                the original exception).
        """
        if self._rank == 0:
            try:
                result = work()
            except Exception as exc:
                self.broadcast_object(_Failure(f"{type(exc).__name__}: {exc}"))
                raise
            return self.broadcast_object(result)
        received: object = self.broadcast_object(None)
        if isinstance(received, _Failure):
            raise DistributedError(f"rank 0 failed while {doing}: {received.message}")
        return cast(T, received)

    def on_every_rank(self, work: Callable[[], T], doing: str) -> list[T]:
        """Run ``work`` on every rank; every rank's result (picklable), in rank order, on every
        rank. Each rank's work may take its own time (its own probe): the gather waits as the
        first agreement does.

        Args:
            work: what each rank does (e.g. probe its own card).
            doing: what it is, for the other ranks' error message (e.g. "probing its own card").

        Raises:
            DistributedError: on the other ranks, when ``work`` raised on some rank (which
                raises the original exception); names the lowest such rank and its error.
        """
        try:
            result: object = work()
        except Exception as exc:
            self.gather_objects(_Failure(f"{type(exc).__name__}: {exc}"))
            raise
        gathered = self.gather_objects(result)
        for rank, received in enumerate(gathered):
            if isinstance(received, _Failure):
                raise DistributedError(f"rank {rank} failed while {doing}: {received.message}")
        return cast(list[T], gathered)

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (two all-reduces: the
        pickles' lengths, then their bytes, each rank filling its own row).

        Raises:
            DistributedError: a peer did not answer within the deadline (names it).
        """
        data = pickle.dumps(obj)
        lengths = torch.zeros(self._world_size, dtype=torch.int64, device=self._device)
        lengths[self._rank] = len(data)
        self._agreements.all_reduce(lengths, dist.ReduceOp.SUM, where=self._where())
        sizes = [int(n) for n in lengths.tolist()]
        rows = torch.zeros(self._world_size, max(sizes), dtype=torch.int64, device=self._device)
        rows[self._rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._agreements.all_reduce(rows, dist.ReduceOp.SUM, where=self._where())
        table = rows.cpu().to(torch.uint8).numpy()
        return [pickle.loads(table[r, : sizes[r]].tobytes()) for r in range(self._world_size)]


class _Failure:
    """What rank 0 broadcasts instead of a result when its work raised."""

    def __init__(self, message: str) -> None:
        self.message = message


def process_group_consensus(device: torch.device | None = None) -> ProcessGroupConsensus | None:
    """The default group's consensus when torch.distributed is initialised, else None.

    Args:
        device: the device this rank probes (see :class:`ProcessGroupConsensus`).
    """
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupConsensus(device=device)
    return None


def consensus_device(
    backend: str,
    *,
    probed: torch.device | None,
    bound: torch.device | None,
    current_cuda_index: Callable[[], int],
) -> torch.device:
    """Where a consensus over ``backend`` puts its tensors.

    gloo and mpi: the CPU. Otherwise (nccl) a CUDA device: the probed one when it is CUDA, else
    the one the group is bound to, else the current one. Pure apart from ``current_cuda_index``,
    which is called only when nothing else says.

    Raises:
        DistributedError: the group is bound to a CUDA device other than the probed one.
    """
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if probed is not None and probed.type == "cuda":
        probed = torch.device("cuda", probed.index if probed.index is not None else 0)
        if bound is not None and bound != probed:
            raise DistributedError(
                f"this rank probes {probed} but its process group is bound to {bound} "
                f"(init_process_group(device_id={bound})); agreeing on {bound} would leave a "
                f"CUDA context on a GPU this rank does not train on. Probe the GPU the group "
                f"is bound to (device='{bound}', with the model moved there), or bind the "
                f"group to {probed}"
            )
        return probed
    if bound is not None:
        return bound
    return torch.device("cuda", current_cuda_index())
