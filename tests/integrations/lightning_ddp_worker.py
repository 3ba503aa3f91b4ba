"""Run by ``test_lightning_integration.py`` as ``python lightning_ddp_worker.py OUT_DIR``: fits
its Classifier with AutobatchFinder under Lightning's DDP strategy on 2 CPU processes (gloo).
Lightning starts rank 1 by running this script again with ``LOCAL_RANK=1``. Each rank probes its own
simulated card, of a different capacity, and writes what it got to ``OUT_DIR/rank{N}.json``."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

import lightning.pytorch as pl  # noqa: E402
from gloo_exit import leave_gloo_worker  # noqa: E402
from test_lightning_integration import Classifier  # noqa: E402

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.integrations.lightning import AutobatchFinder  # noqa: E402

MIB = 2**20
CAPACITY_BYTES = {0: MIB * 3 // 10, 1: MIB // 4}  # rank 1's card is the smaller one


def main(out_dir: Path) -> None:
    warnings.simplefilter("ignore")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES[rank])
    finder = AutobatchFinder(96, device=device, use_store=False)
    module = Classifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finder],
    )
    trainer.fit(module)
    assert finder.plan is not None
    result = {
        "plan": finder.plan.to_dict(),
        "batch_size": module.batch_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "seen": module.seen,
        "first_weight": float(module.net[0].weight.sum()),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_gloo_worker()
