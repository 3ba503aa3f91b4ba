"""The probe leaves the RNG states as they were (README, DESIGN "Leave no trace"), and so does
what autobatch imports on first use: ``autobatch.autotune`` imports the tuning road lazily, a
named remote the HTTP client (httpx, which imports rich, which draws ``random.getrandbits`` at
import), a drop-in its framework. Checked in a fresh process, where nothing is imported yet."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autobatch.extras import keeping_rng, require

SCRIPT = textwrap.dedent(
    """
    import random, sys
    import torch
    import autobatch
    random.seed(0)
    before = random.getstate()
    model = torch.nn.Linear(4, 1)
    plan = autobatch.autotune(model, torch.randn(2, 4), loss_fn=lambda out: out.pow(2).mean(),
                              effective_batch_size=4, device="sim:64MiB")
    print("autotune", random.getstate() == before, "httpx" in sys.modules, plan.world_size)
    from autobatch.tuning import TuneRequest
    request = TuneRequest.build(model, torch.randn(2, 4), loss_fn=lambda out: out.pow(2).mean(),
                                effective_batch_size=4, device="sim:64MiB",
                                report_to="http://127.0.0.1:9")
    print("remote", random.getstate() == before, "httpx" in sys.modules,
          request.store.remote is not None)
    """
)


def test_first_autotune_and_a_named_remote_leave_python_random_state(tmp_path: Path) -> None:
    """The first ``autobatch.autotune`` in a process (with its store) leaves ``random`` as it
    was and imports no HTTP client; naming a remote imports it, and leaves ``random`` too."""
    env = {"AUTOBATCH_STORE": f"sqlite:///{tmp_path / 'profiles.db'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**env, "PYTHONPATH": ":".join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-2:]
    assert lines == ["autotune True False 1", "remote True True True"]
    assert (tmp_path / "profiles.db").is_file()  # the store was opened (sqlalchemy imported)


def test_require_leaves_random_state_when_the_module_draws_at_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "draws_at_import.py").write_text("import random\nDRAWN = random.getrandbits(24)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "draws_at_import", raising=False)
    random.seed(3)
    before = random.getstate()
    module = require("draws_at_import", extra="hf", purpose="a test")
    assert random.getstate() == before
    random.seed(3)
    assert random.getrandbits(24) == module.DRAWN  # it did draw: from the state, then restored


def test_keeping_rng_restores_numpy_and_python_states_after_an_error() -> None:
    numpy = pytest.importorskip("numpy")
    random.seed(5)
    numpy.random.seed(5)
    python, numpys = random.getstate(), numpy.random.get_state()
    with pytest.raises(KeyError), keeping_rng():
        random.random()
        numpy.random.random()
        raise KeyError("inside")
    assert random.getstate() == python
    assert (numpy.random.get_state()[1] == numpys[1]).all()
