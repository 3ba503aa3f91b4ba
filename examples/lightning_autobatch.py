"""A Lightning script switched to autobatch with one line: ``AutobatchFinder`` in the callbacks.

It trains a small GPT-2 (random weights) on synthetic token rows. At fit start the callback probes
the module's own ``training_step`` with its AdamW, then sets ``self.batch_size`` and the Trainer's
``accumulate_grad_batches`` so that micro-batch x accumulation x world size is exactly the
effective batch. Runs anywhere on a simulated card; on GPUs pass ``--device cuda`` (the Trainer's
own device) and ``--devices N`` for DDP, where the ranks agree on one plan::

    python examples/lightning_autobatch.py --device sim:24MiB --effective-batch-size 64 --steps 2
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

from autobatch.device import parse_device
from autobatch.integrations.lightning import AutobatchFinder


class TinyGPT2(pl.LightningModule):
    def __init__(self, *, num_rows: int, seq_len: int) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=seq_len,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)
        # transformers picks the loss from the class name, which here names none: say it,
        # rather than have it warn "`loss_type=None` ... unrecognized" and fall back to it.
        self.model.loss_type = "ForCausalLM"
        self.batch_size = 4  # AutobatchFinder sets it, as BatchSizeFinder would
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 1000, (num_rows, seq_len), generator=generator)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        rows = [{"input_ids": row, "labels": row} for row in self.tokens]
        return torch.utils.data.DataLoader(rows, batch_size=self.batch_size, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="sim:24MiB", help="sim:SIZE (CPU), cuda, or cuda:N")
    parser.add_argument("--devices", type=int, default=1, help="GPUs (DDP when more than one)")
    parser.add_argument("--effective-batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps to train")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")  # Lightning's notes on CPU training, dataloader workers
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    simulated = parse_device(args.device).type == "sim"
    module = TinyGPT2(num_rows=4 * args.effective_batch_size, seq_len=args.seq_len)
    # The one line: was `callbacks=[BatchSizeFinder()]`, which changes the micro-batch only.
    finder = AutobatchFinder(
        args.effective_batch_size, device=args.device if simulated else None, use_store=False
    )
    trainer = pl.Trainer(
        accelerator="cpu" if simulated else "gpu",
        devices=1 if simulated else args.devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finder],
    )
    trainer.fit(module)
    plan = finder.plan
    assert plan is not None
    if trainer.global_rank == 0:
        print(
            f"plan: micro-batch {module.batch_size} x accumulate_grad_batches "
            f"{trainer.accumulate_grad_batches} x world size {trainer.world_size} = "
            f"{module.batch_size * trainer.accumulate_grad_batches * trainer.world_size} "
            f"(largest that fits: {plan.max_micro_batch_size}, {plan.source})"
        )
        loss = float(trainer.callback_metrics["loss"])
        print(f"trained {trainer.global_step} optimizer steps; last loss {loss:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
