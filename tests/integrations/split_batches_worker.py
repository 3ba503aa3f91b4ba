"""Run by ``test_split_batches.py`` as ``torchrun --nproc-per-node 2 split_batches_worker.py
OUT_DIR``: under Accelerate's ``split_batches`` each rank plans the test's Trainer with
``autotune_trainer`` and trains, and asks ``autotune_accelerator`` to plan for an Accelerator
that splits batches; each writes what it got to ``OUT_DIR/rank{N}.json``."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402
from gloo_exit import leave_gloo_worker  # noqa: E402
from test_hf_integration import make_trainer  # noqa: E402

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.errors import ConfigError  # noqa: E402
from autobatch.integrations.accelerate import autotune_accelerator  # noqa: E402
from autobatch.integrations.hf import autotune_trainer  # noqa: E402

MIB = 2**20
EFFECTIVE_BATCH_SIZE = 96


def main(out_dir: Path) -> None:
    warnings.simplefilter("ignore")
    rank = int(os.environ["RANK"])
    trainer = make_trainer(
        out_dir / f"work{rank}", num_rows=384, accelerator_config={"split_batches": True}
    )
    device = SimulatedDevice(capacity_bytes=24 * MIB)
    plan = autotune_trainer(trainer, EFFECTIVE_BATCH_SIZE, device=device, use_store=False)
    seen: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    trainer.train()
    result = {
        "plan": plan.to_dict(),
        "split_batches": trainer.accelerator.split_batches,
        "per_device": trainer.args.per_device_train_batch_size,
        "accumulation": trainer.args.gradient_accumulation_steps,
        "global_step": trainer.state.global_step,
        "seen": seen,
        "first_weight": float(next(trainer.model.parameters()).sum()),
    }
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True)
    )
    model = torch.nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)))
    try:
        autotune_accelerator(
            accelerator, model, loader, 64, device="sim:8MiB", use_store=False,
            loss_fn=lambda output: output.mean(),
        )  # fmt: skip
    except ConfigError as exc:
        result["accelerate_error"] = str(exc)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_gloo_worker()
