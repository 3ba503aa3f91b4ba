"""``profiles list`` and ``show`` say which size is the measured maximum and which the
recommended one, name each card with its memory, and ``show`` reads as words (JSON with
``--json``); a plan's text reconciles the probe's usable bytes with its own budget."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path

import pytest

from autobatch.cli import main
from autobatch.cli._output import input_shapes
from autobatch.cli._profiles import print_profile
from autobatch.store import ProfileStore

TUNE = ["tune", "tests.service.models:tiny_mlp", "--input-shape", "32", "--device", "sim:4MiB"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("profiles") / "s.sqlite3")
    # The memory's edge stops the search (not the batch), and a margin of 0.5 sets the
    # recommended size well below the measured max.
    argv = ["--store", path, *TUNE, "--effective-batch-size", "65536", "--json"]
    assert main([*argv, "--safety-margin", "0.5"]) == 0
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_listing_names_both_sizes_and_the_cards_memory(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    (row,) = json.loads(run(capsys, "--store", store, "profiles", "list", "--json"))
    header, line = run(capsys, "--store", store, "profiles", "list").splitlines()
    columns = ["ID", "CREATED (UTC)", "DEVICE", "MEASURED MAX", "RECOMMENDED"]
    assert re.split(r"\s{2,}", header)[:5] == columns
    cells = re.split(r"\s{2,}", line)
    assert cells[0] == row["id"]
    assert cells[2:5] == [
        "sim (4.00 MiB)",
        str(row["max_micro_batch_size"]),
        str(row["recommended_micro_batch_size"]),
    ]
    assert row["recommended_micro_batch_size"] < row["max_micro_batch_size"]


def test_show_reads_as_words_and_json_on_asking(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    (row,) = json.loads(run(capsys, "--store", store, "profiles", "list", "--json"))
    shown = run(capsys, "--store", store, "profiles", "show", row["id"])
    lines = {line[:20].strip(): line[21:] for line in shown.splitlines()}
    assert lines["device"] == "sim (4.00 MiB)"
    assert lines["measured max"] == f"{row['max_micro_batch_size']} (the largest that ran)"
    assert lines["recommended"].startswith(
        f"{row['recommended_micro_batch_size']} (less the safety margin 0.5"
    )
    assert not shown.lstrip().startswith("{")
    as_json = json.loads(run(capsys, "--store", store, "profiles", "show", row["id"], "--json"))
    assert as_json["max_micro_batch_size"] == row["max_micro_batch_size"]


def test_a_plan_from_a_stored_profile_exports_both_sizes_by_name(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.cli.test_plan_env import sourced

    capsys.readouterr()
    (row,) = json.loads(run(capsys, "--store", store, "profiles", "list", "--json"))
    planned = ["--store", store, "plan", "--profile", row["id"], "--effective-batch-size", "8"]
    exported = sourced(run(capsys, *planned, "--env"))
    recommended, measured = row["recommended_micro_batch_size"], row["max_micro_batch_size"]
    assert exported["AUTOBATCH_RECOMMENDED_MICRO_BATCH_SIZE"] == str(recommended)
    assert exported["AUTOBATCH_MEASURED_MAX_MICRO_BATCH_SIZE"] == str(measured)
    assert exported["AUTOBATCH_MAX_MICRO_BATCH_SIZE"] == str(recommended)  # the older name
    assert exported["AUTOBATCH_PLAN_SOURCE"] == "cached"


def test_a_profile_names_its_model_and_an_old_one_its_short_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Profiles before schema 4 recorded no name: listed by the start of their fingerprint.
    import dataclasses

    from autobatch.profile import Profile
    from tests.planning.test_prediction import issue_profile

    named = dataclasses.replace(issue_profile(), model_name="GPT2LMHeadModel")
    written_by_3 = {**issue_profile(node_name="n2").to_dict(), "schema_version": 3}
    written_by_3["model_fingerprint"] = "9f2c41d0b7e35a8c" * 4
    del written_by_3["model_name"]
    old = Profile.from_dict(written_by_3)
    assert old.model_name == ""
    store = tmp_path / "s.sqlite3"
    with ProfileStore(store) as opened:
        named_id, old_id = opened.put(named), opened.put(old)
    assert main(["--store", str(store), "profiles", "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    models = {row.split()[0]: row[header.index("MODEL") :] for row in rows}
    assert models == {named_id: "GPT2LMHeadModel", old_id: "9f2c41d0b7e3"}
    assert main(["--store", str(store), "profiles", "show", named_id]) == 0
    out = capsys.readouterr().out
    assert "model                GPT2LMHeadModel" in out
    assert f"model fingerprint    {named.model_fingerprint}" in out


def test_the_listing_shows_checkpointing_and_inputs_plainly(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Profiles of one model under three checkpointing modes differ in a column; a tuple's
    # inputs read by kind, not by their positions "0 32, 1 scalar".
    capsys.readouterr()
    header, line = run(capsys, "--store", store, "profiles", "list").splitlines()
    cells = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", line), strict=True))
    assert cells["CHECKPOINTING"] == "none"
    assert cells["INPUT"] == "sample 32"
    assert input_shapes({"0": [32], "1": []}) == "tensor[32], scalar"
    assert input_shapes({"pixels": [3, 224, 224], "label": []}) == "pixels 3x224x224, label scalar"
    (row,) = json.loads(run(capsys, "--store", store, "profiles", "list", "--json"))
    shown = run(capsys, "--store", store, "profiles", "show", row["id"])
    lines = {line[:20].strip(): line[21:] for line in shown.splitlines()}
    assert lines["checkpointing"] == "none (activation checkpointing)"
    assert lines["input"] == "sample 32"


def test_show_words_a_checkpoint_keyword_of_the_recorded_conditions(store: str) -> None:
    with ProfileStore(store) as opened:
        (profile_id, profile), *_ = opened.list_profiles()
    applied = "autobatch checkpoint on 2 blocks (torch.utils.checkpoint, use_reentrant=False)"
    conditions = dataclasses.replace(profile.conditions, activation_checkpointing=applied)
    out = io.StringIO()
    print_profile(profile_id, dataclasses.replace(profile, conditions=conditions), out)
    assert (
        "activation checkpointing: autobatch checkpoint on 2 blocks (torch.utils.checkpoint, "
        "non-reentrant checkpointing)"
    ) in out.getvalue()
    assert "use_reentrant" not in out.getvalue()
