"""``tune --activation-checkpointing auto`` answered by a stored profile whose trials never
timed the plan's micro-batch runs timing trials now: the output says they ran now, and says
"nothing ran now" only where nothing did (issue 46)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from autobatch.cli._commands import _reported_words
from autobatch.cli._output import print_probe_time

PROFILE = SimpleNamespace(
    timings=SimpleNamespace(describe=lambda: "3.43 s: 3 real trials 2.8 s"),
    created_at="2026-12-07T23:06:00+00:00",
)


def _outcome(*num_trials: int) -> SimpleNamespace:
    runs = tuple(SimpleNamespace(num_trials=n) for n in num_trials)
    return SimpleNamespace(chosen="none", runs=runs, probe_time=lambda: "1.15 s over 1 mode")


def test_a_stored_profile_with_timing_trials_run_now_says_so() -> None:
    out = io.StringIO()
    print_probe_time(PROFILE, out, stored=True, checkpointing=_outcome(2))
    lines = out.getvalue().splitlines()
    assert lines[0] == "probe time       1.15 s over 1 mode"
    assert lines[1].endswith(
        "(the stored profile's, probed 2026-12-07 23:06 UTC; its probe did not run now; "
        "2 timing trials did)"
    )
    tuned = SimpleNamespace(plan=SimpleNamespace(source="cached"), checkpointing=_outcome(2))
    assert _reported_words("http://s", tuned) == (
        "autobatch: sent the stored profile to http://s (its probe did not run now; 2 timing "
        "trials did, and are not part of it; the service stores a profile it holds once)"
    )


def test_a_stored_profile_with_nothing_run_now_says_nothing_ran() -> None:
    out = io.StringIO()
    print_probe_time(PROFILE, out, stored=True, checkpointing=_outcome(0, 0))
    assert out.getvalue().splitlines()[1].endswith("UTC; nothing ran now)")
    tuned = SimpleNamespace(plan=SimpleNamespace(source="cached"), checkpointing=None)
    assert "(nothing ran now; the service" in _reported_words("http://s", tuned)
