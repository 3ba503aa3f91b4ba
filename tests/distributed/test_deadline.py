"""A deadline for the ranks' agreements: a rank that stops answering (here: hung inside a probe's
trial, or in its data loader between two windows of the Accumulator) fails the other within a
few seconds, naming it, rather than waiting out the process group's whole timeout (60 s here,
10 to 30 minutes by default). 2 gloo ranks on CPU."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autobatch.distributed._deadline import (
    DEFAULT_MIN_SECONDS,
    MIN_SECONDS_ENV,
    AgreementDeadline,
    resolve_deadline,
)
from autobatch.errors import ConfigError, DistributedError
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group

WORLD_SIZE = 2
GROUP_TIMEOUT_S = 60  # what the waiting rank would wait without a deadline
DEADLINE_S = 3.0


def test_the_deadline_is_the_longer_of_its_floor_and_a_multiple_of_this_ranks_work() -> None:
    deadline = AgreementDeadline(min_seconds=30, step_multiple=5)
    assert deadline.seconds(1.0) == 30
    assert deadline.seconds(10.0) == 50


def test_the_floor_comes_from_the_environment_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MIN_SECONDS_ENV, raising=False)
    assert AgreementDeadline().min_seconds == DEFAULT_MIN_SECONDS
    monkeypatch.setenv(MIN_SECONDS_ENV, "7.5")
    assert AgreementDeadline().min_seconds == 7.5
    monkeypatch.setenv(MIN_SECONDS_ENV, "soon")
    with pytest.raises(ConfigError, match=r"AUTOBATCH_AGREEMENT_SECONDS='soon' must be a number"):
        AgreementDeadline()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_seconds": 0}, r"min_seconds=0 must be a finite number > 0"),
        ({"min_seconds": float("inf")}, r"min_seconds=inf must be a finite number"),
        ({"step_multiple": 0.5}, r"step_multiple=0.5 must be a finite number >= 1"),
        ({"min_seconds": True}, r"min_seconds=True"),
    ],
)
def test_a_deadline_that_is_not_one_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AgreementDeadline(**kwargs)


def test_a_deadline_argument_of_another_kind_is_refused() -> None:
    assert resolve_deadline(None) is None
    with pytest.raises(ConfigError, match=r"deadline 30 must be an AgreementDeadline"):
        resolve_deadline(30)  # type: ignore[arg-type]


def _wait_for(flag: Path, limit_s: float = 90.0) -> None:
    """Hang, as a stuck rank does, until the other rank has written ``flag``."""
    until = time.monotonic() + limit_s
    while not flag.exists() and time.monotonic() < until:
        time.sleep(0.05)


def _probe_worker(rank: int, tmp: str) -> None:
    """Rank 1's train_step hangs in the first trial above micro-batch 1; rank 0 waits for it
    in the agreement after that trial."""
    from autobatch.tuning import autotune_profile

    os.environ[MIN_SECONDS_ENV] = str(DEADLINE_S)  # autotune builds the consensus itself
    join_gloo_group(rank, WORLD_SIZE, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    flag = Path(tmp, "rank0-failed")
    result: dict[str, Any] = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if rank == 1 and batch[0].shape[0] > 1:
            _wait_for(flag)
        return F.cross_entropy(model(batch[0]), batch[1])

    started = time.monotonic()
    try:
        autotune_profile(
            model,
            (torch.randn(4, 8), torch.randint(0, 4, (4,))),
            train_step=train_step,
            device="sim:64MiB",
            use_estimate=False,
            use_store=False,
        )
    except DistributedError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["seconds"] = time.monotonic() - started
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        flag.touch()  # the hung rank may go on: it fails at once in the closed agreement
    os._exit(0)  # the group is broken by design: no teardown


def _loader_worker(rank: int, tmp: str) -> None:
    """Rank 1's loader hangs fetching window 1; rank 0 waits at that window's count."""
    from autobatch.training._accumulator import Accumulator

    join_gloo_group(rank, WORLD_SIZE, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    flag = Path(tmp, "rank0-failed")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(nn.Linear(3, 1).double())
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        gradient_accumulation_steps=2,
        agreement_deadline=AgreementDeadline(min_seconds=DEADLINE_S),
    )

    def loader() -> Iterator[torch.Tensor]:
        for index in range(6):
            if rank == 1 and index == 2:  # the first micro-batch of window 1
                _wait_for(flag)
            yield torch.randn(4, 3, dtype=torch.float64)

    result: dict[str, Any] = {"windows": 0}
    started = time.monotonic()
    try:
        for window in acc.windows(loader()):
            for micro in window:
                with micro.sync_context():
                    micro.backward(model(micro.batch).pow(2).mean())
            window.step()
            result["windows"] += 1
            started = time.monotonic()  # from the end of the last window that ran
    except DistributedError as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    result["seconds"] = time.monotonic() - started
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        flag.touch()
    os._exit(0)


@pytest.mark.slow  # gloo ranks in spawned processes
def test_a_rank_hung_inside_a_probe_trial_fails_the_other_within_the_deadline(
    tmp_path: Path,
) -> None:
    spawn_and_wait(_probe_worker, (str(tmp_path),), WORLD_SIZE, timeout_s=180)
    waiting = json.loads((tmp_path / "rank0.json").read_text())
    assert waiting["error"] == "DistributedError", waiting
    assert "rank 1 did not reach the probe's agreement number" in waiting["message"]
    assert f"within {DEADLINE_S:.0f} s" in waiting["message"]
    assert "AUTOBATCH_AGREEMENT_SECONDS" in waiting["message"]
    # The whole probe, the deadline included: far below the group's 60 s timeout.
    assert waiting["seconds"] < GROUP_TIMEOUT_S / 2, waiting


@pytest.mark.slow  # gloo ranks in spawned processes
def test_a_rank_hung_between_windows_fails_the_other_at_the_next_agreement(
    tmp_path: Path,
) -> None:
    spawn_and_wait(_loader_worker, (str(tmp_path),), WORLD_SIZE, timeout_s=180)
    waiting = json.loads((tmp_path / "rank0.json").read_text())
    assert waiting["windows"] == 1
    assert waiting["error"] == "DistributedError", waiting
    assert "rank 1 did not reach the count agreement of window 1 within 3 s" in (waiting["message"])
    assert waiting["seconds"] < GROUP_TIMEOUT_S / 4, waiting
    late = json.loads((tmp_path / "rank1.json").read_text())  # came late: fails at once too
    assert late["error"] == "DistributedError", late
    assert "failed on rank 1 after every rank reached it" in late["message"]
    assert "another rank gave up waiting there" in late["message"]


SHORT_GROUP_TIMEOUT_S = 5


def _short_group_worker(rank: int, tmp: str, floor: str | None) -> None:
    """A job's own group timeout of 5 s; rank 1 hangs after the first agreement (the one without
    a deadline), so rank 0 waits at the second with the default deadline (its 120 s floor, or
    ``floor`` from the environment)."""
    from autobatch.distributed._deadline import Agreements, group_timeout_seconds

    os.environ.pop(MIN_SECONDS_ENV, None)
    if floor is not None:
        os.environ[MIN_SECONDS_ENV] = floor
    join_gloo_group(rank, WORLD_SIZE, f"{tmp}/rendezvous", timeout_s=SHORT_GROUP_TIMEOUT_S)
    flag = Path(tmp, "rank0-failed")
    agreements = Agreements(None, AgreementDeadline())
    values = torch.ones(1)
    agreements.all_reduce(values, torch.distributed.ReduceOp.SUM, where="the first agreement")
    result: dict[str, Any] = {
        "group_timeout": group_timeout_seconds(None),
        "cap": agreements.cap_seconds,
    }
    if rank == 1:
        _wait_for(flag)
    started = time.monotonic()
    try:
        agreements.all_reduce(values, torch.distributed.ReduceOp.SUM, where="the second one")
    except DistributedError as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    result["seconds"] = time.monotonic() - started
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        flag.touch()
    os._exit(0)  # the group is broken by design: no teardown


@pytest.mark.slow  # gloo ranks in spawned processes
@pytest.mark.parametrize(("floor", "waited"), [(None, "4.5"), ("2", "2")])
def test_an_agreement_never_waits_longer_than_the_process_group_s_own_timeout(
    tmp_path: Path, floor: str | None, waited: str
) -> None:
    # The issue: with the group's timeout at 60 s, rank 0 waited the deadline's 120 s floor;
    # AUTOBATCH_AGREEMENT_SECONDS still shortens it.
    spawn_and_wait(_short_group_worker, (str(tmp_path), floor), WORLD_SIZE, timeout_s=180)
    waiting = json.loads((tmp_path / "rank0.json").read_text())
    assert (waiting["group_timeout"], waiting["cap"]) == (5.0, 4.5)  # less a tenth
    assert waiting["error"] == "DistributedError", waiting
    assert f"rank 1 did not reach the second one within {waited} s" in waiting["message"]
    capped = "capped at the process group's own timeout" in waiting["message"]
    assert capped == (floor is None)
    assert ("init_process_group(timeout=...)" in waiting["message"]) == capped
    assert waiting["seconds"] < 30, waiting  # not the 120 s floor (2 loaded cores: generous)


def test_the_cap_leaves_a_tenth_of_the_group_s_timeout_at_most_5_s() -> None:
    from autobatch.distributed._deadline import group_margin

    assert [t - group_margin(t) for t in (5.0, 60.0, 1800.0)] == [4.5, 55.0, 1795.0]
