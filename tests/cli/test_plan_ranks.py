"""``autobatch plan --rank-max``: a micro-batch per rank from each rank's max (and speed), by
the pure planner; ``tune --mixed-ranks`` in one process plans its own rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autobatch.planning import StepLine
from tests.cli.test_cli import run
from tests.planning.test_mixed import mixed

RANKS = ["--rank-max", "48", "--rank-max", "17"]


def test_rank_max_plans_a_micro_batch_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", *RANKS, "--effective-batch-size", "96")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["rank", "max", "micro-batch"]
    # 96 in one step needs more than 48 + 17: two steps of 48, split so that the largest share
    # of its max any rank fills is the least (36 / 48 = 0.75 beside 12 / 17; 35 + 13 fills
    # 13 / 17 = 0.76).
    assert lines[1].split() == ["0", "48", "36"]
    assert lines[2].split() == ["1", "17", "12"]
    assert "gradient_accumulation_steps  2" in out
    assert "effective_batch_size 96 = 48 (micro_batch_size summed over 2 ranks" in out


def test_rank_max_with_speeds_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "plan",
        *RANKS,
        *["--rank-seconds-per-sample", "0.004", "--rank-seconds-per-sample", "0.0065"],
        *["--effective-batch-size", "96", "--json"],
    )
    assert code == 0, err
    ranks = json.loads(out)["ranks"]
    lines = [StepLine(per_sample_seconds=0.004), StepLine(per_sample_seconds=0.0065)]
    want = mixed([48, 17], effective_batch_size=96, step_lines=lines)
    assert [r["micro_batch_size"] for r in ranks] == [p.micro_batch_size for p in want]
    assert ranks[0]["rank_micro_batch_sizes"] == list(want[0].rank_micro_batch_sizes or ())
    slowest = max(line.seconds(r["micro_batch_size"]) for line, r in zip(lines, ranks, strict=True))
    assert ranks[0]["predicted_seconds_per_effective_batch"] == pytest.approx(
        want[0].gradient_accumulation_steps * slowest
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--world-size", "3"], "--world-size 3 is not the number of --rank-max given (2)"),
        (["--rank-seconds-per-sample", "0.1"], "1 --rank-seconds-per-sample for 2 --rank-max"),
        (["--allow-inexact"], "--allow-inexact do(es) not go with --rank-max"),
        (["--format", "deepspeed"], "DeepSpeed takes one micro-batch size for every rank"),
        (["--effective-batch-size", "1"], "argument --effective-batch-size: 1 is less than"),
    ],
)
def test_rank_max_refusals_name_the_flag(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["plan", *RANKS, "--effective-batch-size", "96", *extra]
    code, out, err = run(capsys, *argv)
    assert code != 0
    assert message in err, err


def test_rank_seconds_without_rank_max_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys,
        *["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "64"],
        *["--rank-seconds-per-sample", "0.1"],
    )
    assert code != 0 and "--rank-seconds-per-sample goes with --rank-max" in err


def test_tune_mixed_ranks_in_one_process_plans_its_own_rank(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run(
        capsys,
        *["--store", str(tmp_path / "s.sqlite3"), "tune", "gpt2-tiny", "--seq-len", "32"],
        *["--device", "sim:48MiB", "--effective-batch-size", "64", "--mixed-ranks", "--json"],
    )
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["rank_micro_batch_sizes"] == [plan["micro_batch_size"]]
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == 64


def test_rank_max_takes_a_comma_list_as_world_size_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The comma list and the flag once per rank are one plan; a list may repeat a value (two
    # ranks of one card), and the speeds take the same two spellings.
    code, repeated, err = run(capsys, "plan", *RANKS, "--effective-batch-size", "96")
    assert code == 0, err
    assert run(capsys, "plan", "--rank-max", "48,17", "--effective-batch-size", "96") == (
        0,
        repeated,
        "",
    )
    code, out, err = run(
        capsys, "plan", "--rank-max", "48,48,17", "--rank-seconds-per-sample", "0.004,0.004",
        "--rank-seconds-per-sample", "0.0065", "--effective-batch-size", "96", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert [rank["max_micro_batch_size"] for rank in json.loads(out)["ranks"]] == [48, 48, 17]
    code, _, err = run(capsys, "plan", "--rank-max", "48,,17", "--effective-batch-size", "96")
    assert "argument --rank-max: '48,,17' has an empty item; e.g. 24,24,12" in err
