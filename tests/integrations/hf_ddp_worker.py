"""Run by ``test_hf_integration.py`` as ``torchrun --nproc-per-node 2 hf_ddp_worker.py OUT_DIR``:
each rank builds the test's Trainer (CPU, gloo), probes its own simulated card (rank 1's smaller)
with ``autotune_trainer`` and trains; each writes what it got to ``OUT_DIR/rank{N}.json``."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

import torch  # noqa: E402
from gloo_exit import leave_gloo_worker  # noqa: E402
from test_hf_integration import make_trainer  # noqa: E402

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.integrations.hf import autotune_trainer  # noqa: E402

MIB = 2**20
CAPACITY_BYTES = {0: 24 * MIB, 1: 20 * MIB}


def main(out_dir: Path) -> None:
    warnings.simplefilter("ignore")
    rank = int(os.environ["RANK"])
    trainer = make_trainer(out_dir / f"work{rank}", num_rows=192)
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES[rank])
    plan = autotune_trainer(trainer, 96, device=device, use_store=False)
    seen: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    trainer.train()
    result = {
        "plan": plan.to_dict(),
        "per_device": trainer.args.per_device_train_batch_size,
        "accumulation": trainer.args.gradient_accumulation_steps,
        "total": trainer.get_total_train_batch_size(trainer.args),
        "global_step": trainer.state.global_step,
        "seen": seen,
        "first_weight": float(next(trainer.model.parameters()).sum()),
        "distributed": torch.distributed.is_initialized(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_gloo_worker()
