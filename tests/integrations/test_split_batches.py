"""Accelerate's ``split_batches``: the dataloader's batch is the batch of all ranks,
split among them. ``autotune_trainer`` plans for it (each rank trains the plan's micro-batch, so
the rows per optimizer step are the effective batch asked, not half of it on 2 ranks);
``autotune_accelerator``, which leaves the dataloader to the user, refuses it by name. 2 gloo
ranks under torchrun, a real Trainer and Accelerator on the CPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
EFFECTIVE_BATCH_SIZE = 96


@pytest.mark.slow  # two ranks under torchrun
def test_split_batches_trains_the_effective_batch_asked_or_is_refused_by_name(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe_port:  # a free port for the ranks' rendezvous
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        str(Path(__file__).with_name("split_batches_worker.py")), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as done:  # fmt: skip
        try:
            _, stderr = done.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(done.pid, signal.SIGKILL)
            pytest.fail("torchrun with 2 ranks did not finish within 300 s (a hang)")
    assert done.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    plan = ranks[0]["plan"]
    assert ranks[1]["plan"] == plan and plan["world_size"] == 2
    micro, steps = plan["micro_batch_size"], plan["gradient_accumulation_steps"]
    for rank in ranks:
        assert rank["split_batches"] is True
        # The loader's batch is both ranks' micro-batches; Accelerate gives each its half.
        assert (rank["per_device"], rank["accumulation"]) == (2 * micro, steps)
        assert rank["global_step"] == 2
        assert rank["seen"] == [micro] * (2 * steps)
    # Rows trained per optimizer step, over both ranks: the effective batch asked.
    assert sum(ranks[0]["seen"][:steps]) + sum(ranks[1]["seen"][:steps]) == EFFECTIVE_BATCH_SIZE
    assert ranks[0]["first_weight"] == ranks[1]["first_weight"]
    for rank in ranks:
        message = rank["accelerate_error"]
        assert message.startswith(
            "Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True)) splits "
            "each dataloader batch over the 2 processes"
        )
        assert "use split_batches=False" in message
