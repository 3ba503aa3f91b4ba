"""``bench/integrations_vs_peers.py --quick`` runs end to end (in a subprocess, as by hand, so the
frameworks' warnings stay out of this session's ``filterwarnings = error``): the drop-ins keep
the effective batch exact and train at their sizes without OOM; the peers' runs change it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_integrations_vs_peers_quick_keeps_the_effective_batch_only_for_autobatch() -> None:
    done = subprocess.run(
        [sys.executable, "bench/integrations_vs_peers.py", "--quick"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[2]: line.split() for line in done.stdout.splitlines() if "MiB" in line}
    assert set(rows) == {
        "AutobatchFinder",
        "BatchSizeFinder",
        "autotune_trainer",
        "auto_find_batch_size",
    }
    # columns: framework card tool start trials steps OOMs micro accum eff.batch exact train-OOMs
    for tool in ("AutobatchFinder", "autotune_trainer"):
        row = rows[tool]
        assert int(row[7]) * int(row[8]) == int(row[9]) == 48
        assert row[10] == "yes" and row[11] == "0"
    for tool in ("BatchSizeFinder", "auto_find_batch_size"):
        assert rows[tool][10] == "NO" and int(rows[tool][9]) < 48
