"""The limit agreement: how the ranks of a DistributedDataParallel job split a micro-batch together.

With ``on_oom="split"`` under DDP, :func:`autobatch.training._oom_split.run_window` has the ranks
agree once per micro-step: they all-reduce one small tensor, each rank's piece-size limit and
whether it failed, and all adopt the smallest limit, so they split together. (Not the
Accumulator's window agreement, :mod:`autobatch.training._window_agreement`, which carries an error
to the others between windows; nor the probe's consensus, :mod:`autobatch.distributed._consensus`.)

An error on one rank before a limit agreement (a batch that does not fit, a ``ConfigError``, the
user's ``loss_of``, an ``on_split`` callback) is taken to the limit agreement the other ranks wait
at, so they raise :class:`~autobatch.errors.DistributedError` at once instead of waiting. On the
last micro-step the agreement comes after the forward of the final piece and before its
synchronised backward: that piece is the last one that counts items (later pieces count none and
are not run), backward's own checks (a mean over 0 counted items) run before the agreement, and a
smaller size another rank made known there is reported (``on_split`` included) after the backward
(if the callback raises, the other ranks learn of it at the Accumulator's next window agreement:
the next window's count, or the end of the data). An error *inside* that backward cannot be agreed
on (the others are already in the all-reduce): that rank raises ``DistributedError`` and aborts
the process group, and the others fail when its process ends (gloo notices at once; gloo's abort
alone does not reach them) or at the process group's timeout, so let that error end the process.
Pieces are local (ranks may run different numbers of forward passes), so a forward pass must not
communicate: a model with buffers needs ``DistributedDataParallel(..., broadcast_buffers=False)``
and none may have a ``SyncBatchNorm`` in training mode (:func:`refuse_collective_forward` refuses
both on every rank before any step); a ``loss_of`` that runs a collective itself (an all-reduce of
the loss for logging) is caught at its first call, on every rank alike, by the process groups'
collective counts (:meth:`LimitAgreement.refuse_collectives`), before any rank splits.

Example::

    ranks = LimitAgreement(agreements, device, window_index=3, num_micro_steps=4)
    agreed = ranks.meet(0, limit=8)  # the smallest limit of any rank; None: every rank runs whole
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from autobatch.distributed import Agreements
from autobatch.errors import ConfigError, DistributedError, DoesNotFitError

__all__ = ["LimitAgreement", "refuse_collective_forward"]

logger = logging.getLogger("autobatch")

_NO_LIMIT = 2**62  # "run whole" in the limit agreement (a MIN all-reduce)
# A rank's failure in the agreement (MIN-reduced: the lower one is named to the other ranks).
_FAILED = -1  # an error before the agreement: the user's forward, a check, a callback
_DOES_NOT_FIT = -2  # DoesNotFitError


class LimitAgreement:
    """The limit agreements of one ``run_window`` call under DDP (see the module docstring).

    Args:
        agreements: the Accumulator's agreements over the ``DistributedDataParallel`` model's
            process group (one sequence with the window agreements, under one deadline).
        device: where the all-reduced tensor lives (the parameters' device; NCCL needs CUDA).
        window_index: the window being run, for messages.
        num_micro_steps: micro-steps in the window; the last one's agreement is the last the
            other ranks wait at.
    """

    __slots__ = (
        "agreements",
        "device",
        "group",
        "num_agreed",
        "num_micro_steps",
        "owes_agreement",
        "peers_know",
        "rank",
        "window_index",
    )

    def __init__(
        self,
        agreements: Agreements,
        device: torch.device,
        *,
        window_index: int,
        num_micro_steps: int,
    ) -> None:
        self.agreements = agreements
        self.group = agreements.group
        self.device = device
        self.window_index = window_index
        self.num_micro_steps = num_micro_steps
        self.rank = agreements.rank
        self.num_agreed = 0
        """Micro-steps whose agreement is done."""
        self.owes_agreement = True
        """Whether the other ranks will wait for this one at an agreement: from the window's
        start to its last micro-step's, which comes before the synchronised backward."""
        self.peers_know = False
        """Whether every rank knows of this window's failure: it came from an agreement
        (another rank's), or the group was aborted or failed; :meth:`tell` sets it too."""

    def meet(self, index: int, limit: int | None, *, error: Exception | None = None) -> int | None:
        """Micro-step ``index``'s agreement: every rank's limit and failure, MIN-reduced.

        Args:
            index: the micro-step, 0-based.
            limit: this rank's largest piece (rows), or None when it runs micro-batches whole.
            error: this rank's error, when it failed and raises it next.

        Returns:
            The smallest limit of any rank (None: every rank runs whole); None on a rank that
            brought an error.

        Raises:
            DistributedError: another rank failed (and this one did not).
        """
        self.num_agreed = index + 1
        self.owes_agreement = False  # also when the collective fails: no rank is left to meet
        failure = 0
        if error is not None:
            failure = _DOES_NOT_FIT if isinstance(error, DoesNotFitError) else _FAILED
        ranks = self.agreements.world_size
        # A failure packed with its rank: the MIN names the worst failure's lowest rank.
        mine = [limit if limit is not None else _NO_LIMIT, failure * ranks + self.rank]
        if not failure:
            mine[1] = 0
        flags = torch.tensor(mine, dtype=torch.int64, device=self.device)
        self.peers_know = True  # told, or the collective failed: none to tell again
        where = f"micro-batch {index} of window {self.window_index}"
        self.agreements.all_reduce(
            flags, dist.ReduceOp.MIN, where=f"the limit agreement of {where}"
        )
        agreed = int(flags[0])
        worst, failed_rank = divmod(int(flags[1]), ranks)
        if failure:
            return None  # this rank raises its own error
        if worst == _DOES_NOT_FIT:
            raise DistributedError(
                f"rank {failed_rank} could not fit {where} even at the smallest micro-batch "
                "size and raised DoesNotFitError; this rank stops too"
            )
        if worst:
            raise DistributedError(
                f"rank {failed_rank} raised an error in {where} before the ranks agreed to run "
                "it (see that rank's error); this rank stops too, so that no rank waits for it"
            )
        self.peers_know = False  # the agreement went well: a later error is this rank's alone
        self.owes_agreement = index < self.num_micro_steps - 1
        return None if agreed == _NO_LIMIT else agreed

    def collectives(self, model: torch.nn.Module) -> tuple[int, ...] | None:
        """How many collectives this rank has issued on the model's group and the default
        group (c10d's sequence numbers), and whether DDP has rebuilt its gradient buckets (the
        first forward after the first backward broadcasts their order, on every rank alike);
        None where the backend does not count them."""
        groups = [self.group, dist.group.WORLD]
        try:
            counts = [
                int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
                for group in groups
                if group is not None
            ]
        except (AttributeError, RuntimeError):
            return None
        return (*counts, int(bool(getattr(model, "_has_rebuilt_buckets", False))))

    def refuse_collectives(
        self, model: torch.nn.Module, before: tuple[int, ...] | None, where: str
    ) -> None:
        """Raise when the user's ``loss_of`` issued a collective since ``before`` (not counting
        a call in which DDP rebuilt its buckets: its own, on every rank alike).

        Raises:
            ConfigError: it did: a piece runs on one rank only, so when one rank splits the
                others would be left in (or paired wrongly with) that collective. Every rank
                runs the same ``loss_of``, so every rank raises here, at the same micro-step.
        """
        after = self.collectives(model)
        if before is None or after is None or after == before or after[-1] != before[-1]:
            return
        raise ConfigError(
            f"loss_of ran {max(b - a for a, b in zip(before, after, strict=True))} collective(s) "
            f"(torch.distributed) in {where}; with on_oom='split' the pieces of a split "
            "micro-batch run on one rank only, so when one rank runs out of memory the others "
            "would be left in that collective, or pair it with another. Move the collective out "
            "of loss_of (log the loss after window.run), or use on_oom='raise'"
        )

    def tell(self, error: Exception, limit: int | None) -> None:
        """After an error on this rank, meet the other ranks at the agreement they wait at, with
        the failure, so that they raise too instead of waiting for the process group's timeout."""
        if not self.owes_agreement:
            return
        try:
            self.meet(self.num_agreed, limit, error=error)
        except Exception:  # noqa: BLE001 - a broken group: this rank's own error matters more
            logger.warning("could not tell the other ranks of this rank's error", exc_info=True)

    def abort(self) -> None:
        """Close this rank's connections so that peers waiting in a collective (the synchronised
        backward's all-reduce, past the last agreement) fail at once."""
        self.peers_know = True  # nothing can be told: the group is aborted
        target = self.group if self.group is not None else dist.group.WORLD
        abort = getattr(target, "abort", None)
        try:
            if callable(abort):
                abort()
            else:
                dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - best effort: the error being raised matters more
            logger.exception("could not abort the process group after an OOM in backward")


def refuse_collective_forward(model: torch.nn.Module) -> None:
    """Pieces run on one rank only, so under DDP a forward pass must not communicate.

    Raises:
        ConfigError: ``model`` (a ``DistributedDataParallel``) broadcasts its module's buffers at
            every forward (``broadcast_buffers=True``, torch's default, and the module has
            buffers), or the module has a ``SyncBatchNorm`` in training mode (it gathers
            statistics from every rank at every forward).
    """
    remedy = "or use on_oom='raise'"
    module = model.module if isinstance(model, DistributedDataParallel) else model
    if isinstance(model, DistributedDataParallel) and model.will_sync_module_buffers():  # type: ignore[no-untyped-call]
        name = next(iter(model.named_module_buffers), "")  # the buffers DDP broadcasts
        raise ConfigError(
            "on_oom='split' runs the pieces of a split micro-batch on one rank only, but this "
            f"DistributedDataParallel broadcasts the model's buffers (such as {name!r}) from "
            "rank 0 at every forward pass, which the other ranks would not join; construct it "
            "with DistributedDataParallel(model, broadcast_buffers=False) (from torch 2.13: "
            "forward_sync_buffers=False); buffers such as BatchNorm statistics then stay per "
            f"rank; {remedy}"
        )
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.SyncBatchNorm) and layer.training:
            raise ConfigError(
                "on_oom='split' runs the pieces of a split micro-batch on one rank only, but "
                f"the model's SyncBatchNorm layer {name!r} gathers statistics from every rank at "
                f"every forward pass in training mode; use BatchNorm instead, {remedy}"
            )
