"""What `autobatch tune` prints says how each number came about: the recommended micro-batch
beside the measured maximum, a maximum predicted
from another card's profile and confirmed by one trial says so, a stored profile's probe time is
dated as the stored one's, and the progress line counts trials in words."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autobatch.cli import main
from autobatch.store import ProfileStore

TUNE = ["tune", "tests.service.models:tiny_mlp", "--input-shape", "32"]
TUNE += ["--effective-batch-size", "64"]


def tune(capsys: pytest.CaptureFixture[str], store: Path, device: str) -> tuple[str, str]:
    code = main(["--store", str(store), *TUNE, "--device", device])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def line(out: str, start: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(start))


def test_a_confirmed_prediction_says_so_and_a_stored_probe_time_is_dated(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = tmp_path / "s.sqlite3"
    out, _ = tune(capsys, store, "sim:4MiB")  # probed: the profile another card predicts from
    assert re.fullmatch(
        r"recommended      64  \(measured maximum 64: \d+ trials, 0 OOM, (probe|doubling)\)",
        line(out, "recommended"),
    )
    assert "predicted" not in line(out, "recommended")

    out, _ = tune(capsys, store, "sim:6MiB")  # another card: predicted, then one trial
    assert re.fullmatch(
        r"recommended      64  \(maximum 64 predicted from another card's profile, "
        r"confirmed by one trial at 64: \d+ trials, 0 OOM\)",
        line(out, "recommended"),
    )
    assert line(out, "note:") == (
        "note: 64 was predicted from another card's profile and confirmed by one trial here, not "
        "searched to this card's memory edge: larger micro-batches may fit; --refresh probes "
        "this card"
    )
    ran_now = line(out, "probe time")
    assert "stored" not in ran_now

    out, err = tune(capsys, store, "sim:6MiB")  # the same card again: from the store
    assert "source                       cached" in out and "probing" not in err
    with ProfileStore(store, create="never") as opened:
        (newest, _), *_ = opened.list_profiles()
        created = opened.get(newest).created_at
    when = created[:16].replace("T", " ")
    assert line(out, "probe time") == (
        f"{ran_now}  (the stored profile's, probed {when} UTC; nothing ran now)"
    )
    assert "confirmed by one trial at 64" in line(out, "recommended")


def test_the_progress_line_counts_trials_in_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _, err = tune(capsys, tmp_path / "s.sqlite3", "sim:4MiB")
    assert ": 1 trial (micro-batch 1 fits" in err
    # stderr captured (not a terminal): a line an event, the last one the confirm stage
    last = err.rstrip("\n").splitlines()[-1]
    assert "\r" not in err
    assert re.fullmatch(
        r"probing, confirm \(the chosen size's second step\): \d+ trials \(micro-batch 64 "
        r"fits, peak [\d.]+ KiB\); at most \d+ left",
        last,
    )
    assert "0trial" not in err and "trial/s" not in err and "trials/s" not in err


def test_report_to_sends_the_stored_profile_too_and_says_what_it_sent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A profile stored before --report-to was given reaches the service on the next run (the
    # service stores a profile it holds once); each run says in one line what it sent.
    from autobatch.client._remote import ServiceProfiles

    sent: list[str] = []
    monkeypatch.setattr(ServiceProfiles, "profiles_of", lambda self, identity: ([], ""))
    monkeypatch.setattr(
        ServiceProfiles, "report", lambda self, profile: sent.append(profile.created_at) or ""
    )
    store = tmp_path / "s.sqlite3"
    url = "http://autobatch.example:8000"
    tune(capsys, store, "sim:4MiB")  # probed and stored, reported nowhere
    assert sent == []
    code = main(["--store", str(store), *TUNE, "--device", "sim:4MiB", "--report-to", url])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "source                       cached" in out
    with ProfileStore(store, create="never") as opened:
        ((newest, _),) = opened.list_profiles()
        assert sent == [opened.get(newest).created_at]  # the stored one, sent as it is
    assert err.splitlines()[-1] == (
        f"autobatch: sent the stored profile to {url} (nothing ran now; the service stores a "
        "profile it holds once)"
    )
    code = main(["--store", str(store), *TUNE, "--device", "sim:8MiB", "--report-to", url])
    err = capsys.readouterr().err
    assert code == 0 and len(sent) == 2
    assert err.splitlines()[-1] == f"autobatch: sent the profile to {url}"


def test_report_to_that_fails_says_so_and_claims_nothing_sent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autobatch.client._remote import ServiceProfiles

    monkeypatch.setattr(ServiceProfiles, "profiles_of", lambda self, identity: ([], ""))
    monkeypatch.setattr(ServiceProfiles, "report", lambda self, profile: "the service said 503")
    store = tmp_path / "s.sqlite3"
    tune(capsys, store, "sim:4MiB")
    code = main(["--store", str(store), *TUNE, "--device", "sim:4MiB", "--report-to", "http://x"])
    err = capsys.readouterr().err
    assert code == 0
    assert "the service said 503" in err and "sent the" not in err
