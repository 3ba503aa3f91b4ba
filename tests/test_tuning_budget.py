"""The tuning road and the CLI on a declared fraction of a card: two trials sharing a
card each plan for their share, the plan and the CLI's output say which source decided and how
the card is shared, and a scheduler learns how many such trials fit on one card."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import autobatch
from autobatch.cli import main
from autobatch.device import SimulatedDevice
from autobatch.errors import ConfigError
from autobatch.profile import Profile

MiB = 2**20
CARD = 64 * MiB


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)
    )
    return model, (torch.randn(1, 256), torch.randint(0, 8, (1,)))


def tune(**kwargs: object) -> autobatch.Plan:
    model, sample = mlp()
    return autobatch.autotune(
        model,
        sample,
        effective_batch_size=8192,
        loss_fn=torch.nn.functional.cross_entropy,
        use_store=False,
        **kwargs,  # type: ignore[arg-type]
    )


def test_two_trials_on_one_card_each_plan_for_their_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    whole = tune(device=SimulatedDevice(capacity_bytes=CARD))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        half = tune(device=f"sim:{CARD}B", gpu_fraction=0.5)

    assert whole.predicted_peak_memory_bytes is not None
    assert whole.predicted_peak_memory_bytes > CARD // 2  # two of these would not fit
    assert whole.budget is not None
    assert (whole.budget.deciding_source, whole.budget.sharing_mode) == ("simulated", "none")
    assert whole.budget.trials_per_gpu == 1
    assert half.capacity_bytes == CARD // 2
    assert half.predicted_peak_memory_bytes is not None
    assert half.predicted_peak_memory_bytes <= CARD // 2
    assert half.budget is not None
    assert (half.budget.deciding_source, half.budget.sharing_mode) == (
        "gpu_fraction",
        "fractional",
    )
    assert half.budget.trials_per_gpu == 2
    assert half.budget.fits_now is True
    assert any("sharing mode fractional" in r.getMessage() for r in caplog.records)
    # The plan carries it through its dict, as the CLI's JSON and the service write it.
    assert autobatch.Plan.from_dict(half.to_dict()) == half


def test_the_profile_records_the_budget_it_was_probed_under() -> None:
    model, sample = mlp()
    profile = autobatch.probe(
        model,
        sample,
        loss_fn=torch.nn.functional.cross_entropy,
        device=f"sim:{CARD}B",
        gpu_fraction=0.25,
        max_micro_batch_size=4096,
    )
    assert profile.capacity_bytes == CARD // 4
    assert profile.budget is not None and profile.budget.deciding_source == "gpu_fraction"
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_a_fraction_outside_zero_to_one_is_refused_before_any_step() -> None:
    with pytest.raises(ConfigError, match=r"gpu_fraction 0 must be a number in \(0, 1\]"):
        tune(device=f"sim:{CARD}B", gpu_fraction=0)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


TINY = ["tests.service.models:tiny_mlp", "--input-shape", "32"]


def test_the_cli_shows_the_deciding_source_and_the_sharing_mode(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--store", str(tmp_path / "s.sqlite3"), "tune", *TINY, "--device", "sim:4MiB"]
    argv += ["--effective-batch-size", "4096", "--gpu-fraction", "0.5"]

    code, out, err = run(capsys, *argv)

    assert code == 0, err
    assert (
        "memory budget                2.00 MiB, decided by --gpu-fraction (sharing: fractional)"
        in out
    )
    assert "  simulated                  4.00 MiB usable of 4.00 MiB" in out
    assert "  --gpu-fraction             2.00 MiB usable of 2.00 MiB" in out
    assert "jobs that fit one GPU        2" in out  # jobs per card, not probe trials
    assert "trials per GPU" not in out
    assert "warning: --gpu-fraction allows 2.00 MiB where simulated reports 4.00 MiB" in out
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    budget = json.loads(out)["plan"]["budget"]
    assert (budget["deciding_source"], budget["sharing_mode"]) == ("gpu_fraction", "fractional")
    assert json.loads(out)["profile"]["budget"]["budget_bytes"] == 2 * MiB


def test_the_cli_plans_a_stored_profile_for_a_share_of_a_card(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = str(tmp_path / "s.sqlite3")
    code, out, err = run(
        capsys,
        "--store",
        store,
        "tune",
        *TINY,
        "--device",
        "sim:4MiB",
        "--effective-batch-size",
        "256",
        "--json",
    )
    assert code == 0, err
    (profile_id,) = [
        line.split()[0]
        for line in run(capsys, "--store", store, "profiles", "list")[1].splitlines()[1:]
    ]

    code, out, err = run(
        capsys,
        *["--store", store, "plan", "--profile", profile_id, "--effective-batch-size", "256"],
        *["--capacity", "4MiB", "--gpu-fraction", "0.25", "--json"],
    )

    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["capacity_bytes"] == MiB
    assert plan["budget"]["readings"][0]["source"] == "capacity_bytes"
    assert plan["budget"]["deciding_source"] == "gpu_fraction"
    assert plan["predicted_peak_memory_bytes"] <= MiB
    code, out, err = run(
        capsys,
        *["--store", store, "plan", "--profile", profile_id, "--effective-batch-size", "256"],
        *["--capacity", "4MiB", "--gpu-fraction", "0.25", "--world-size", "1,2"],
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["world", "size", "micro-batch", "accumulation", "steps", "note"]
    assert "memory budget                1.00 MiB, decided by --gpu-fraction" in out  # after it
    code, _, err = run(
        capsys,
        *["--store", store, "plan", "--profile", profile_id, "--effective-batch-size", "256"],
        "--gpu-fraction",
        "0.5",
    )
    assert code == 1 and "--gpu-fraction needs --capacity" in err
    code, _, err = run(
        capsys,
        "plan",
        "--max-micro-batch-size",
        "4",
        "--effective-batch-size",
        "8",
        "--gpu-fraction",
        "1.5",
    )
    assert code == 2 and "must be in (0, 1]" in err
