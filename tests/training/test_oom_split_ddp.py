"""Window.run(on_oom="split") under DistributedDataParallel: 2 gloo processes on CPU where only
rank 1 runs out of memory. The ranks split together and keep the global gradient; an OOM inside
the synchronised backward makes both ranks raise at once instead of hanging."""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from autobatch.errors import SmallMicroBatchNormWarning
from autobatch.training._accumulator import Accumulator
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import leave_gloo_worker
from tests.training.test_oom_split import HEAVY, GatedModel, fake_oom, mse

WORLD_SIZE = 2
# A hang fails the test through this bound; the process group's own timeout is far longer, so
# only the abort can end a rank that waits in the all-reduce.
SPAWN_TIMEOUT_S = 90.0
PG_TIMEOUT = datetime.timedelta(seconds=600)


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for i in range(4):  # 2 windows of 2 micro-batches of 8 rows
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        x[:, 0] = torch.arange(8) + 100 * i + 500 * rank  # row ids, all below HEAVY
        out.append((x, torch.randn(8, 1, generator=g, dtype=torch.float64)))
    return out


def _init(rank: int, store_path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE,
        timeout=PG_TIMEOUT,
    )  # fmt: skip


# Where rank 1's heavy row sits (micro-batch of window 0) and where it runs out of memory at 8
# rows: in the backward of the first micro-batch (local, then the window is recomputed), or in
# the forward of the last one (then its final piece is agreed on before the synchronised
# backward, while rank 0 waits with its own final forward done).
CASES = {"backward": 0, "forward": 1}


def _split_worker(rank: int, store_path: str, out_dir: str, phase: str) -> None:
    _init(rank, store_path)
    try:
        data = _data(rank)
        if rank == 1:
            data[CASES[phase]][0][2, 0] = HEAVY

        def oom_when(where: str, rows: torch.Tensor) -> bool:
            heavy = bool((rows[:, 0] == HEAVY).any())
            return where == phase and heavy and rows.shape[0] > 4

        model = GatedModel(oom_when)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        acc = Accumulator(ddp, opt, gradient_accumulation_steps=2, on_oom="split")
        results = []
        for window in acc.windows(data):
            before = [p.detach().clone() for p in model.parameters()]
            stats = window.run(lambda batch: mse(ddp, batch))
            results.append(
                {
                    "grad": [
                        (b - p.detach()).tolist()
                        for b, p in zip(before, model.parameters(), strict=True)
                    ],
                    "splits": [
                        [s.phase, s.old_micro_batch_size, s.new_micro_batch_size]
                        for s in stats.splits
                    ],  # fmt: skip
                    "limit": stats.micro_batch_size_limit,
                    "before": [b.tolist() for b in before],
                }
            )
        results.append({"seen": [len(rows) for rows in model.gate.seen]})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_gloo_worker()


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(CASES))
def test_ddp_ranks_split_together_and_keep_the_global_gradient(tmp_path: Path, phase: str) -> None:
    spawn_and_wait(
        _split_worker,
        (str(tmp_path / "store"), str(tmp_path), phase),
        WORLD_SIZE,
        SPAWN_TIMEOUT_S,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    # Rank 1 ran out of memory; rank 0 adopted the smaller size at the agreement.
    assert ranks[1][0]["splits"] == [[phase, 8, 4]]
    assert ranks[0][0]["splits"] == [["peer", 8, 4]]
    assert [w["limit"] for w in ranks[0][:2]] == [4, 4] == [w["limit"] for w in ranks[1][:2]]
    if phase == "backward":
        # Rank 0: micro-batch 0 whole, then pieces of 4. Rank 1: 8 (failed in backward), then
        # the window again from micro-batch 0 in pieces of 4.
        assert ranks[0][2]["seen"] == [8, 4, 4, 4, 4, 4, 4]
        assert ranks[1][2]["seen"] == [8, 4, 4, 4, 4, 4, 4, 4, 4]
    else:
        # Both ran window 0 whole but rank 1's last micro-batch, which failed in forward and
        # ran as two pieces (the second synchronised); window 1 in pieces of 4 on both.
        assert ranks[0][2]["seen"] == [8, 8, 4, 4, 4, 4]
        assert ranks[1][2]["seen"] == [8, 8, 4, 4, 4, 4, 4, 4]
    for window in range(2):
        assert ranks[0][window]["grad"] == ranks[1][window]["grad"]  # the same all-reduced step
        model = GatedModel(lambda phase, rows: False)
        with torch.no_grad():
            for p, v in zip(model.parameters(), ranks[0][window]["before"], strict=True):
                p.copy_(torch.tensor(v, dtype=torch.float64))
        batches = [_data(r)[2 * window + i] for r in range(WORLD_SIZE) for i in range(2)]
        if window == 0:
            batches[2 + CASES[phase]][0][2, 0] = HEAVY
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        want = torch.autograd.grad(mse(model, (x, y)), list(model.parameters()))
        for got, w in zip(ranks[0][window]["grad"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), w, rtol=1e-12,
                                       atol=1e-12)  # fmt: skip


def _failing_worker(rank: int, store_path: str, out_dir: str, phase: str) -> None:
    """Rank 1 runs out of memory on one row whatever the size: in the backward of the window's
    last micro-batch (synchronised), or in the forward of its first (agreed on, then raised)."""
    _init(rank, store_path)
    outcome: dict[str, Any] = {}
    try:
        data = _data(rank)
        if rank == 1:
            data[1 if phase == "backward" else 0][0][0, 0] = HEAVY

        def oom_when(where: str, rows: torch.Tensor) -> bool:
            return where == phase and bool((rows[:, 0] == HEAVY).any())

        model = GatedModel(oom_when)
        ddp = DistributedDataParallel(model)
        acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0),
                          gradient_accumulation_steps=2, on_oom="split")  # fmt: skip
        start = time.monotonic()
        try:
            for window in acc.windows(data):
                window.run(lambda batch: mse(ddp, batch))
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        outcome["seconds"] = time.monotonic() - start
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    if phase == "forward":  # the group is sound: both past the agreement before teardown
        leave_gloo_worker()
    # Rank 1 aborted the group and rank 0's is broken; tearing gloo down from here can race its
    # background threads into SIGABRT, after the errors this test checks.
    os._exit(0)


@pytest.mark.slow
def test_ddp_oom_in_the_synchronised_backward_makes_every_rank_raise(tmp_path: Path) -> None:
    assert fake_oom().args  # the gate raises torch's CUDA-like OOM
    spawn_and_wait(
        _failing_worker,
        (str(tmp_path / "store"), str(tmp_path), "backward"),
        WORLD_SIZE,
        SPAWN_TIMEOUT_S,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert ranks[1]["error"] == "DistributedError"
    assert "rank 1 ran out of memory inside the synchronised backward of micro-batch 1 of " \
        "window 0" in ranks[1]["message"]  # fmt: skip
    assert "process group was aborted" in ranks[1]["message"]
    assert ranks[0]["error"] == "DistributedError"
    assert (
        "synchronised backward of micro-batch 1 of window 0 failed on rank 0"
        in (ranks[0]["message"])
    )
    # Far below the process group's 600 s timeout: rank 0 did not wait for it.
    assert ranks[0]["seconds"] < PG_TIMEOUT.total_seconds() / 10


@pytest.mark.slow
def test_ddp_a_row_that_fits_nowhere_makes_every_rank_raise(tmp_path: Path) -> None:
    spawn_and_wait(
        _failing_worker,
        (str(tmp_path / "store"), str(tmp_path), "forward"),
        WORLD_SIZE,
        SPAWN_TIMEOUT_S,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert ranks[1]["error"] == "DoesNotFitError"
    assert (
        "micro-batch 0 of window 0 does not fit even at micro-batch size 1" in (ranks[1]["message"])
    )
    assert ranks[0]["error"] == "DistributedError"
    assert "rank 1 could not fit micro-batch 0 of window 0" in ranks[0]["message"]


# -- an error on one rank only never leaves the other waiting ---------------------------------

# Short, so that a rank left waiting (the failure these tests guard against) fails the test
# with gloo's timeout instead of hanging it; every rank here must finish far sooner.
SHORT_PG_TIMEOUT = datetime.timedelta(seconds=20)
IGNORED = -100.0  # a target that counts nothing, like a label of -100


def masked_mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error over the counted rows (a mean over none is NaN)."""
    x, y = batch
    keep = y[:, 0] != IGNORED
    return ((model(x) - y)[keep] ** 2).mean()


def num_counted(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    return int((batch[1][:, 0] != IGNORED).sum())


def _one_rank_worker(rank: int, store_path: str, out_dir: str, case: str) -> None:
    """One window of 2 micro-batches of 8 rows per rank; ``case`` says what rank 1 (or, for a
    callback, rank 0) meets."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE,
        timeout=SHORT_PG_TIMEOUT,
    )  # fmt: skip
    outcome: dict[str, Any] = {}
    try:
        data = _data(rank)[:2]
        heavy_at = {
            "final_piece_counts_nothing": 1, "callback": 0, "callback_last": 1, "backward_error": 1,
            "communicating_loss": 0,
        }  # fmt: skip
        if rank == 1 and case in heavy_at:
            data[heavy_at[case]][0][2, 0] = HEAVY  # runs out of memory in forward above 4 rows
        if rank == 1 and case == "final_piece_counts_nothing":
            data[1][1][4:, 0] = IGNORED  # its second half counts nothing
        if rank == 1 and case == "last_counts_nothing":
            data[1][1][:, 0] = IGNORED  # the whole last micro-batch counts nothing

        def oom_when(where: str, rows: torch.Tensor) -> bool:
            heavy = bool((rows[:, 0] == HEAVY).any())
            if case == "backward_error":
                if where == "backward" and heavy:
                    raise RuntimeError("a custom backward failed")
                return False
            return where == "forward" and heavy and rows.shape[0] > 4

        def on_split(event: Any) -> None:
            if rank == 0 and case.startswith("callback"):  # split_recorder writes on rank 0 only
                raise RuntimeError("attempt to write a readonly database")

        model = GatedModel(oom_when)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1.0)
        acc = Accumulator(
            ddp, optimizer, gradient_accumulation_steps=2, on_oom="split", on_split=on_split
        )
        before = [p.detach().clone() for p in model.parameters()]
        start = time.monotonic()

        def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            loss = masked_mse(ddp, batch)
            if case == "communicating_loss":  # the mean over the ranks, for a log line
                dist.all_reduce(loss.detach().clone())
            return loss

        try:
            for window in acc.windows(data, count_fn=num_counted):
                stats = window.run(loss_of)
                outcome["splits"] = [
                    [s.phase, s.old_micro_batch_size, s.new_micro_batch_size] for s in stats.splits
                ]
        except Exception as exc:
            outcome["error"] = type(exc).__name__
            outcome["message"] = str(exc)
        outcome["seconds"] = time.monotonic() - start
        outcome["before"] = [b.tolist() for b in before]
        outcome["grad"] = [
            (b - p.detach()).tolist() for b, p in zip(before, model.parameters(), strict=True)
        ]
        outcome["seen"] = [len(rows) for rows in model.gate.seen]
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    if case == "backward_error":
        # Rank 1 aborted the group; gloo's abort does not reach rank 0, which fails when rank 1's
        # process ends (as an uncaught error ends it). Leave without teardown, as
        # _failing_worker does.
        os._exit(0)
    leave_gloo_worker()


def _run_one_rank_case(tmp_path: Path, case: str) -> list[dict[str, Any]]:
    spawn_and_wait(
        _one_rank_worker, (str(tmp_path / "store"), str(tmp_path), case), WORLD_SIZE,
        SPAWN_TIMEOUT_S,
    )  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for outcome in ranks:  # nobody waited for gloo's timeout
        assert outcome["seconds"] < SHORT_PG_TIMEOUT.total_seconds() / 2
    return ranks


@pytest.mark.slow
def test_ddp_a_loss_of_that_communicates_is_refused_on_every_rank_before_a_split(
    tmp_path: Path,
) -> None:
    # loss_of all-reduces the loss for a log line, and rank 1 runs out of memory inside it (in
    # the forward, before that all-reduce) on its first micro-batch. Splitting there would run
    # rank 1's pieces, each with an all-reduce rank 0 never issues: rank 0, whose all-reduce
    # paired with rank 1's first piece's, would go on alone. The collective is seen at loss_of's
    # first call on each rank, and both raise.
    ranks = _run_one_rank_case(tmp_path, "communicating_loss")
    for outcome in ranks:
        assert outcome["error"] == "ConfigError", outcome
        assert (
            "loss_of ran 1 collective(s) (torch.distributed) in micro-batch 0 of window 0"
            in (outcome["message"])
        )
        assert "on_oom='raise'" in outcome["message"]
        assert outcome["grad"] == [[[0.0] * 3] * 4, [0.0] * 4, [[0.0] * 4], [0.0]]


@pytest.mark.slow
def test_ddp_a_last_piece_that_counts_nothing_is_not_run_and_the_gradient_is_global(
    tmp_path: Path,
) -> None:
    # Rank 1's last micro-batch runs out of memory whole; its halves count 4 and 0 items. Run as
    # the synchronised piece, the half that counts nothing would take a mean over 0 items: a
    # ConfigError on rank 1 after the ranks agreed, rank 0 left in the all-reduce. The last
    # counted piece synchronises instead, and the half that counts nothing adds nothing.
    ranks = _run_one_rank_case(tmp_path, "final_piece_counts_nothing")
    assert "error" not in ranks[0] and "error" not in ranks[1]
    assert ranks[1]["splits"] == [["forward", 8, 4]]
    assert ranks[0]["splits"] == [["peer", 8, 4]]
    assert ranks[1]["seen"] == [8, 8, 4]  # the half counting nothing did not run
    assert ranks[0]["grad"] == ranks[1]["grad"]
    model = GatedModel(lambda phase, rows: False)
    with torch.no_grad():
        for p, v in zip(model.parameters(), ranks[0]["before"], strict=True):
            p.copy_(torch.tensor(v, dtype=torch.float64))
    batches = _data(0)[:2] + _data(1)[:2]
    batches[3][0][2, 0] = HEAVY
    batches[3][1][4:, 0] = IGNORED
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    want = torch.autograd.grad(masked_mse(model, (x, y)), list(model.parameters()))
    for got, w in zip(ranks[0]["grad"], want, strict=True):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), w, rtol=1e-12,
                                   atol=1e-12)  # fmt: skip


@pytest.mark.slow
def test_ddp_a_mean_over_nothing_on_one_rank_makes_every_rank_raise(tmp_path: Path) -> None:
    # No out-of-memory at all: rank 1's last micro-batch counts 0 items and the loss is a mean.
    # Checked before the agreement, so rank 0 learns of it there instead of waiting.
    ranks = _run_one_rank_case(tmp_path, "last_counts_nothing")
    assert ranks[1]["error"] == "ConfigError"
    assert (
        "micro-step 1 of window 0 has 0 counted items, so a mean loss is NaN"
        in (ranks[1]["message"])
    )
    assert "reduction='sum'" in ranks[1]["message"]
    assert ranks[0]["error"] == "DistributedError"
    assert (
        "rank 1 raised an error in micro-batch 1 of window 0 before the ranks agreed"
        in (ranks[0]["message"])
    )
    assert ranks[0]["grad"] == ranks[1]["grad"] == [[[0.0] * 3] * 4, [0.0] * 4, [[0.0] * 4], [0.0]]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["callback", "callback_last"])
def test_ddp_a_split_callback_that_raises_on_rank_0_leaves_no_rank_waiting(
    tmp_path: Path, case: str
) -> None:
    # Rank 1 runs out of memory, rank 0 adopts the smaller size and its on_split callback (a
    # store written on rank 0 only, as split_recorder does) raises. At the first micro-step the
    # error is agreed on at the next agreement; at the last one the callback runs after the
    # synchronised backward, so rank 1 is not left in its all-reduce, and learns of the error
    # at the Accumulator's next agreement (here the end of the micro-batches), rather than going
    # on alone to wait in the next window's count all-reduce.
    ranks = _run_one_rank_case(tmp_path, case)
    assert ranks[0]["error"] == "RuntimeError"
    assert ranks[0]["message"] == "attempt to write a readonly database"
    assert ranks[1]["error"] == "DistributedError"
    if case == "callback":
        assert "rank 0 raised an error in micro-batch 1 of window 0" in ranks[1]["message"]
    else:
        assert ranks[1]["splits"] == [["forward", 8, 4]]
        assert (
            "rank 0 raised an error in Window.run of window 0 (see that rank's error); this rank "
            "stops too, at the end of the micro-batches after 1 windows" in ranks[1]["message"]
        )


@pytest.mark.slow
def test_ddp_any_error_in_the_synchronised_backward_is_a_distributed_error_on_every_rank(
    tmp_path: Path,
) -> None:
    # Not an OOM: a custom autograd function fails in rank 1's synchronised backward, where
    # rank 0 is already in the all-reduce. Rank 1 aborts the group as for an OOM (it used to
    # blame "another rank" for its own error and leave the group as it was).
    ranks = _run_one_rank_case(tmp_path, "backward_error")
    assert ranks[1]["error"] == "DistributedError"
    assert (
        "the synchronised backward of micro-batch 1 of window 0 failed on rank 1 (RuntimeError: "
        "a custom backward failed)" in ranks[1]["message"]
    )
    assert "process group was aborted" in ranks[1]["message"]
    assert ranks[0]["error"] == "DistributedError"
    assert (
        "synchronised backward of micro-batch 1 of window 0 failed on rank 0"
        in (ranks[0]["message"])
    )


def _forward_collective_worker(rank: int, store_path: str, out_dir: str, case: str) -> None:
    """A model with BatchNorm under DDP: buffers broadcast at every forward, or
    (``"per_rank"``) kept per rank with ``broadcast_buffers=False``."""
    _init(rank, store_path)
    outcome: dict[str, Any] = {}
    try:
        warnings.simplefilter("ignore", SmallMicroBatchNormWarning)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
        ).double()
        ddp = DistributedDataParallel(model, broadcast_buffers=case == "broadcast_buffers")
        acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0),
                          gradient_accumulation_steps=2, on_oom="split")  # fmt: skip
        forwards: list[int] = []

        def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            forwards.append(batch[0].shape[0])
            return mse(ddp, batch)

        try:
            for window in acc.windows(_data(rank)):
                window.run(loss_of)
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        outcome["forwards"] = forwards
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    leave_gloo_worker()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("broadcast_buffers", "DistributedDataParallel(model, broadcast_buffers=False)"),
        ("per_rank", None),
    ],
)
def test_ddp_a_forward_that_communicates_is_refused_on_every_rank_before_any_step(
    tmp_path: Path, case: str, match: str | None
) -> None:
    # A piece runs on one rank only: a forward pass that broadcasts buffers would meet no
    # partner on the other ranks. (SyncBatchNorm: test_splitting.py; DDP refuses it on CPU.)
    spawn_and_wait(
        _forward_collective_worker, (str(tmp_path / "store"), str(tmp_path), case), WORLD_SIZE,
        SPAWN_TIMEOUT_S,
    )  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for outcome in ranks:
        if match is None:
            assert "error" not in outcome
            assert outcome["forwards"] == [8, 8, 8, 8]
        else:
            assert outcome["error"] == "ConfigError"
            assert match in outcome["message"] and "or use on_oom='raise'" in outcome["message"]
            assert outcome["forwards"] == []
