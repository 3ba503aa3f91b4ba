"""The store layer's remote: profiles beyond the local store come from, and go to,
whatever :class:`~autobatch.store.ProfileRemote` the road passes down; the store layer knows
nothing of HTTP. A hand-written fake stands in for the central service."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autobatch import SimulatedDevice
from autobatch.distributed._consensus import LocalConsensus
from autobatch.errors import ReportWarning
from autobatch.probing._options import ProbeOptions, StepSpec
from autobatch.profile import Profile, StepIdentity
from autobatch.store import ProfileRemote, ProfileStore
from autobatch.tuning import find_profile
from autobatch.tuning._cache import StoreOptions, agreed_profile
from tests.store.test_store import make_profile


class Shelf:
    """A remote that keeps profiles in memory: it answers from ``kept``, records what it was
    asked and given, and fails as told (``unreachable``, ``refusal``: the words it says)."""

    def __init__(
        self, kept: list[Profile] | None = None, *, unreachable: str = "", refusal: str = ""
    ) -> None:
        self.kept = list(kept or [])
        self.asked: list[StepIdentity] = []
        self.reported: list[Profile] = []
        self.unreachable = unreachable
        self.refusal = refusal

    def profiles_of(self, identity: StepIdentity) -> tuple[list[tuple[str, Profile]], str]:
        self.asked.append(identity)
        if self.unreachable:
            return [], self.unreachable
        fingerprint = identity.model_fingerprint
        return [
            (f"shelf {index}", profile)
            for index, profile in enumerate(self.kept)
            if profile.identity.model_fingerprint == fingerprint
        ], ""

    def report(self, profile: Profile) -> str:
        if self.refusal:
            return self.refusal
        self.reported.append(profile)
        return ""


def test_the_fake_is_a_profile_remote() -> None:
    remote: ProfileRemote = Shelf()  # mypy on this file checks the protocol here
    assert remote.profiles_of(StepIdentity(model_fingerprint="fp")) == ([], "")


def test_a_new_profile_goes_to_the_remote_and_so_does_a_cached_one(tmp_path: Path) -> None:
    # The remote may not hold a stored profile (the store filled before report_to was given):
    # it is sent again when it answers, and a service stores a profile it holds once.
    shelf = Shelf()
    probed = make_profile()
    storing = StoreOptions(store=tmp_path / "s.sqlite3", remote=shelf)
    runs: list[Profile] = []

    def run_probe() -> Profile:
        runs.append(probed)
        return probed

    def tuned() -> tuple[Profile, bool]:
        found = agreed_profile(
            LocalConsensus(),
            probed.cache_key(),
            storing,
            accepts=lambda p: True,
            run_probe=run_probe,
        )
        return found.profile, found.cached

    assert tuned() == (probed, False)
    assert shelf.reported == [probed]
    assert tuned() == (probed, True)  # from the store, no probe: sent as it was stored
    assert shelf.reported == [probed, probed] and len(runs) == 1


def test_a_remote_that_refuses_the_profile_warns_in_its_words_at_the_callers_line(
    tmp_path: Path,
) -> None:
    shelf = Shelf(refusal="the shelf is full; send it later")
    probed = make_profile()
    words = (
        "the shelf is full; send it later. The plan is returned and the profile is in the local "
        "store; use refresh=True (probe again and send it)"
    )
    with pytest.warns(ReportWarning, match=f"^{re.escape(words)}$") as caught:
        found = agreed_profile(
            LocalConsensus(),
            probed.cache_key(),
            StoreOptions(store=tmp_path / "s.sqlite3", remote=shelf),
            accepts=lambda p: True,
            run_probe=lambda: probed,
        )
    assert found.profile == probed and found.profile_id is not None  # stored all the same
    assert caught[0].filename == __file__
    with ProfileStore(tmp_path / "s.sqlite3") as store:
        assert [profile for _, profile in store.list_profiles()] == [probed]
    # Without a store, the warning never says the profile was kept.
    with pytest.warns(ReportWarning, match="The plan is returned and no store kept the profile;"):
        agreed_profile(
            LocalConsensus(),
            probed.cache_key(),
            StoreOptions(use_store=False, remote=shelf),
            accepts=lambda p: True,
            run_probe=lambda: probed,
        )


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def test_the_road_asks_the_remote_it_is_given_and_probes_when_it_cannot_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shelf = Shelf(unreachable="the shelf is locked")
    step = StepSpec.build(
        mlp(), (torch.randn(2, 16), torch.randint(0, 4, (2,))), loss_fn=F.cross_entropy
    )
    options = ProbeOptions.build(
        step,
        device=SimulatedDevice(capacity_bytes=2 << 20),
        use_estimate=False,
        search_limit=8,
    )
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        found = find_profile(step, options, StoreOptions(use_store=False, remote=shelf))
    assert shelf.asked == [step.identity]
    assert "the shelf is locked; probing this card without it" in caplog.text
    assert not found.cached and found.profile.trials  # probed here
    assert shelf.reported == [found.profile]
