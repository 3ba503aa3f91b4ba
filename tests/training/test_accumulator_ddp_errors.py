"""An error on one rank only never leaves another waiting in a collective: the Accumulator's
agreements under DistributedDataParallel (2 gloo processes on CPU, on_oom="raise").

Each rank's error reaches the others at the next agreement (a window's count, the one before its
synchronised backward, the end of the micro-batches), so every rank raises within seconds. The
process group's timeout is short, so that a rank left waiting fails the test instead of hanging.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autobatch.training._accumulator import Accumulator
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import leave_gloo_worker

WORLD_SIZE = 2
PG_TIMEOUT = datetime.timedelta(seconds=20)  # a rank left waiting fails at this
SPAWN_TIMEOUT_S = 90.0
MAX_SECONDS = 10.0  # every rank raises long before the process group's timeout
IGNORED = -100.0  # a target that counts nothing, like a label of -100


class Shifted(nn.Module):
    """A linear layer plus a buffer: DDP broadcasts the buffer at every forward pass (its default
    broadcast_buffers=True), so the ranks' forward passes are collectives too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 1).double()
        self.register_buffer("shift", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.shift


def masked_mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error over the counted rows (a mean over none is NaN)."""
    x, y = batch
    keep = y[:, 0] != IGNORED
    return ((model(x) - y)[keep] ** 2).mean()


def _data(rank: int, num_micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [
        (
            torch.randn(4, 3, generator=g, dtype=torch.float64),
            torch.randn(4, 1, generator=g, dtype=torch.float64),
        )
        for _ in range(num_micro_batches)
    ]


# What rank 1 meets (rank 0 runs normally): "window/micro" of the micro-batch concerned.
CASES = {
    "count_fn_raises": "1/0",  # count_fn raises on rank 1 for window 1
    "negative_count": "1/1",  # count_fn returns -3 on rank 1 for window 1
    "mean_over_nothing": "0/0",  # a "mean" loss over 0 counted items, not the last micro-step
    "mean_over_nothing_last": "1/1",  # the same on window 1's last micro-step, in Window.run
    "step_raises": "0/-",  # the optimizer's step raises on rank 1 in window 0 of 2
    "step_raises_last": "1/-",  # the same in the last window
    "uneven": "-/-",  # rank 1 has 1 window, rank 0 has 2: both stop after 1
    "skip_window": "0/0",  # as mean_over_nothing, and every rank catches the error and goes on
    # Window.run's loss_of raises on rank 1's last micro-step, in a window where rank 0's first
    # micro-batch counts 0 items (a "sum" loss), so the ranks agree before the synchronised
    # backward.
    "run_raises": "0/1",
}


def _worker(rank: int, store_path: str, out_dir: str, case: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE,
        timeout=PG_TIMEOUT,
    )  # fmt: skip
    outcome: dict[str, Any] = {"windows": 0, "skipped": []}
    try:
        model = Shifted()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1.0)
        where = CASES[case]
        fail_window = int(where.split("/")[0]) if where[0] != "-" else -1
        fail_micro = int(where.split("/")[1]) if where[-1] != "-" else -1
        data = _data(rank, 2 if rank == 1 and case == "uneven" else 4)
        fails = rank == 1
        if fails and case.startswith(("mean_over_nothing", "skip_window")):
            data[2 * fail_window + fail_micro][1][:, 0] = IGNORED
        if rank == 0 and case == "run_raises":
            data[0][1][:, 0] = IGNORED
        if fails and case.startswith("step_raises"):
            step = optimizer.step

            def failing_step(*args: Any, **kwargs: Any) -> Any:
                if outcome["windows"] == fail_window:
                    raise RuntimeError("the optimizer's step failed on this rank")
                return step(*args, **kwargs)

            optimizer.step = failing_step  # type: ignore[method-assign]
        seen = [0]

        def count_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
            index = seen[0]
            seen[0] += 1
            if fails and index == 2 * fail_window + fail_micro:
                if case == "count_fn_raises":
                    raise RuntimeError("cannot read the labels")
                if case == "negative_count":
                    return -3
            return int((batch[1][:, 0] != IGNORED).sum())

        acc = Accumulator(ddp, optimizer, gradient_accumulation_steps=2)
        start = time.monotonic()
        try:
            for window in acc.windows(data, count_fn=count_fn):
                before = [p.detach().clone() for p in model.parameters()]
                try:
                    if case == "mean_over_nothing_last":
                        window.run(lambda batch: masked_mse(ddp, batch))
                    elif case == "run_raises":

                        def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
                            if fails and batch is data[2 * fail_window + fail_micro]:
                                raise RuntimeError("the forward pass failed on this rank")
                            x, y = batch
                            keep = y[:, 0] != IGNORED
                            return ((ddp(x) - y)[keep] ** 2).sum()

                        window.run(loss_of, reduction="sum")
                    else:
                        for micro in window:
                            with micro.sync_context():
                                micro.backward(masked_mse(ddp, micro.batch))
                        window.step()
                except Exception as exc:
                    if case != "skip_window":
                        raise
                    outcome["skipped"].append([window.index, type(exc).__name__, str(exc)])
                    continue
                outcome["windows"] += 1
                outcome["grad"] = [
                    (b - p.detach()).tolist()
                    for b, p in zip(before, model.parameters(), strict=True)
                ]
        except Exception as exc:
            outcome["error"] = type(exc).__name__
            outcome["message"] = str(exc)
        outcome["seconds"] = time.monotonic() - start
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    leave_gloo_worker()


def _run(tmp_path: Path, case: str) -> list[dict[str, Any]]:
    spawn_and_wait(
        _worker, (str(tmp_path / "store"), str(tmp_path), case), WORLD_SIZE, SPAWN_TIMEOUT_S
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for rank, outcome in enumerate(ranks):  # nobody waited for the process group's timeout
        assert outcome["seconds"] < MAX_SECONDS, (rank, outcome)
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("count_fn_raises", "RuntimeError", "cannot read the labels"),
        ("negative_count", "ConfigError", "count_fn returned -3"),
    ],
)
def test_ddp_a_count_fn_error_on_one_rank_makes_every_rank_raise(
    tmp_path: Path, case: str, error: str, message: str
) -> None:
    # Rank 1's count_fn fails for window 1; rank 0 does not wait in window 1's count all-reduce.
    ranks = _run(tmp_path, case)
    assert ranks[1]["error"] == error
    assert message in ranks[1]["message"]
    assert ranks[0]["error"] == "DistributedError"
    assert (
        "rank 1 raised an error while fetching or counting its micro-batches for window 1"
        in ranks[0]["message"]
    )
    assert ranks[0]["windows"] == ranks[1]["windows"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mean_over_nothing", "mean_over_nothing_last"])
def test_ddp_a_backward_config_error_on_one_rank_makes_every_rank_raise(
    tmp_path: Path, case: str
) -> None:
    # A "mean" loss over 0 counted items on rank 1 only. On a micro-step before the last (rank 0
    # runs on, and its forward passes broadcast the buffer) the error is kept until the
    # agreement before the synchronised backward, so rank 0 does not wait in DDP's all-reduce.
    ranks = _run(tmp_path, case)
    window, micro = CASES[case].split("/")
    assert ranks[1]["error"] == "ConfigError"
    assert (
        f"micro-step {micro} of window {window} has 0 counted items, so a mean loss is NaN"
        in ranks[1]["message"]
    )
    assert ranks[0]["error"] == "DistributedError"
    assert f"rank 1 refused the backward of a micro-step of window {window}" in ranks[0]["message"]
    assert "before the synchronised backward" in ranks[0]["message"]
    assert ranks[0]["windows"] == ranks[1]["windows"] == int(window)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "where"), [("step_raises", "count"), ("step_raises_last", "end")])
def test_ddp_an_optimizer_step_error_on_one_rank_makes_every_rank_raise(
    tmp_path: Path, case: str, where: str
) -> None:
    # Rank 1's window.step() fails after the gradient all-reduce; rank 0 neither waits in the next
    # window's count all-reduce nor, after the last window, goes on alone.
    ranks = _run(tmp_path, case)
    window = int(CASES[case].split("/")[0])
    assert ranks[1]["error"] == "RuntimeError"
    assert ranks[1]["message"] == "the optimizer's step failed on this rank"
    assert ranks[0]["error"] == "DistributedError"
    assert f"rank 1 raised an error in window.step() of window {window}" in ranks[0]["message"]
    if where == "count":
        assert "the count agreement of window 1" in ranks[0]["message"]
    else:
        assert "the end of the micro-batches after 2 windows" in ranks[0]["message"]
    assert ranks[0]["windows"] == window + 1 and ranks[1]["windows"] == window


@pytest.mark.slow
def test_ddp_ranks_with_different_numbers_of_windows_stop_together(tmp_path: Path) -> None:
    # Rank 1's micro-batches run out after window 0 while rank 0 has a window 1: rank 0 does not
    # wait in window 1's count all-reduce, and both stop after window 0 without an error (the
    # agreed stop, in detail in test_accumulator_ddp_uneven.py).
    ranks = _run(tmp_path, "uneven")
    for outcome in ranks:
        assert "error" not in outcome, outcome
        assert outcome["windows"] == 1


@pytest.mark.slow
def test_ddp_a_window_failed_on_one_rank_can_be_skipped_on_every_rank(tmp_path: Path) -> None:
    # Both ranks catch the window's error and go on: its gradients were dropped on every rank, so
    # window 1 steps with the global mean of window 1 alone, the same on both ranks.
    ranks = _run(tmp_path, "skip_window")
    assert [s[:2] for s in ranks[1]["skipped"]] == [[0, "ConfigError"]]
    assert [s[:2] for s in ranks[0]["skipped"]] == [[0, "DistributedError"]]
    assert "error" not in ranks[0] and "error" not in ranks[1]
    assert ranks[0]["windows"] == ranks[1]["windows"] == 1
    assert ranks[0]["grad"] == ranks[1]["grad"]
    model = Shifted()
    batches = [_data(r, 4)[2 + i] for r in range(WORLD_SIZE) for i in range(2)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    want = torch.autograd.grad(masked_mse(model, (x, y)), list(model.parameters()))
    for got, w in zip(ranks[0]["grad"], want, strict=True):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), w, rtol=1e-12,
                                   atol=1e-12)  # fmt: skip


@pytest.mark.slow
def test_ddp_a_forward_error_in_window_run_on_one_rank_makes_every_rank_raise(
    tmp_path: Path,
) -> None:
    # Rank 1's loss_of raises on the last micro-step; rank 0, past its last forward pass, used to
    # wait in DDP's gradient all-reduce. (Rank 0's empty micro-batch makes the ranks agree
    # before the synchronised backward in this window.)
    ranks = _run(tmp_path, "run_raises")
    assert ranks[1]["error"] == "RuntimeError"
    assert ranks[1]["message"] == "the forward pass failed on this rank"
    assert ranks[0]["error"] == "DistributedError"
    assert (
        "rank 1 raised an error in Window.run of window 0 (see that rank's error); this rank "
        "stops too, at the agreement before the synchronised backward of window 0"
        in ranks[0]["message"]
    )
    assert ranks[0]["windows"] == ranks[1]["windows"] == 0
