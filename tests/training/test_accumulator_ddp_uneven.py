"""Uneven streaming shards under DDP: when one rank's micro-batches run out, every
rank stops after the same optimizer step, with the same weights, and says what it left untrained;
no rank raises and none waits. 2 gloo processes on the CPU."""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Iterator
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
STEPS = 3  # gradient_accumulation_steps
ROWS = 4  # rows per micro-batch
SHARDS = {0: 10, 1: 7}  # micro-batches per rank: windows of 3,3,3,1 and 3,3,1
PG_TIMEOUT = datetime.timedelta(seconds=20)  # a rank left waiting fails at this


def _worker(rank: int, store_path: str, out_dir: str, shards: dict[int, int]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE,
        timeout=PG_TIMEOUT,
    )  # fmt: skip
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("autobatch").addHandler(handler)
    outcome: dict[str, Any] = {"steps": 0, "trained": 0}
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(3, 1).double())
    acc = Accumulator(
        ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), gradient_accumulation_steps=STEPS
    )

    def stream() -> Iterator[torch.Tensor]:  # a streaming shard: its length is not known
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(shards[rank]):
            yield torch.randn(ROWS, 3, generator=g, dtype=torch.float64)

    started = time.monotonic()
    try:
        for window in acc.windows(stream()):
            for micro in window:
                with micro.sync_context():
                    micro.backward(ddp(micro.batch).pow(2).mean())
                outcome["trained"] += 1
            window.step()
            outcome["steps"] += 1
    except Exception as exc:
        outcome.update(error=type(exc).__name__, message=str(exc))
    outcome["seconds"] = time.monotonic() - started
    stop = acc.uneven_stop
    outcome["stop"] = None if stop is None else [
        stop.window_index, list(stop.exhausted_ranks), stop.rank,
        stop.num_untrained_micro_batches, stop.num_untrained_items,
    ]  # fmt: skip
    outcome["warnings"] = logged
    outcome["weights"] = [p.detach().tolist() for p in ddp.parameters()]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    leave_gloo_worker()


def _run(tmp_path: Path, shards: dict[int, int]) -> list[dict[str, Any]]:
    spawn_and_wait(_worker, (str(tmp_path / "store"), str(tmp_path), shards), WORLD_SIZE, 120)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.mark.slow  # gloo ranks in spawned processes
def test_uneven_shards_stop_every_rank_at_the_same_step_and_say_what_was_left(
    tmp_path: Path,
) -> None:
    # The issue: the rank that ran out first raised DistributedError, and so did the others.
    ranks = _run(tmp_path, SHARDS)
    for outcome in ranks:
        assert "error" not in outcome, outcome
        assert outcome["steps"] == 3  # windows 0, 1 and 2 (rank 1's last one partial)
        assert outcome["seconds"] < PG_TIMEOUT.total_seconds() / 2  # nobody waited it out
    assert (ranks[0]["trained"], ranks[1]["trained"]) == (9, 7)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same optimizer steps everywhere
    # Window 3: rank 0's one micro-batch (4 rows) untrained; rank 1 had none left.
    assert ranks[0]["stop"] == [3, [1], 0, 1, ROWS]
    assert ranks[1]["stop"] == [3, [1], 1, 0, ROWS]
    (warning,) = ranks[0]["warnings"]
    assert warning.startswith(
        "rank 1 ran out of micro-batches after 3 window(s): every rank stopped after 3 optimizer "
        "step(s) (uneven shards); rank 0 leaves 1 micro-batch(es) of window 3 untrained (4 "
        "counted items over all ranks)"
    )
    assert len(ranks[1]["warnings"]) == 1


@pytest.mark.slow  # gloo ranks in spawned processes
def test_even_shards_end_without_a_stop_or_a_warning(tmp_path: Path) -> None:
    ranks = _run(tmp_path, {0: 7, 1: 7})
    for outcome in ranks:
        assert "error" not in outcome, outcome
        assert (outcome["steps"], outcome["trained"], outcome["stop"]) == (3, 7, None)
        assert outcome["warnings"] == []
