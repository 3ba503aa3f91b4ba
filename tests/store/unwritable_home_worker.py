"""Run by test_store_fallback.py as root: imports everything first, then becomes the uid given in
argv (as OpenShift's arbitrary uid, HOME=/), and plans through autotune, ``autobatch tune`` and
the Lightning finder, printing one JSON line: each road's plan and the store warnings it logged.

The privileges are dropped inside this process rather than before exec because the interpreter
lives under /root, which another uid may not read; what is imported before the drop is all that
is needed after it."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sqlite3  # noqa: F401  (imported lazily when a store opens)
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import sqlalchemy.dialects.sqlite  # noqa: F401  (imported lazily when a store opens)
import torch
import torch.nn.functional as F

import autobatch
import autobatch.store._engine  # noqa: F401
import autobatch.store._fallback  # noqa: F401
import autobatch.store._schema  # noqa: F401
from autobatch.cli import main
from autobatch.integrations.lightning import AutobatchFinder


def build() -> torch.nn.Module:
    """The CLI's ``__main__:build`` factory."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build()
        self.batch_size = 4
        self.data = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), torch.zeros(len(batch[0]), 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = torch.utils.data.TensorDataset(self.data)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def road(name: str, run: Any, results: dict[str, Any]) -> None:
    caught = Caught()
    logging.getLogger("autobatch.store").addHandler(caught)
    try:
        results[name] = {"answer": run(), "warnings": caught.messages}
    except Exception as exc:  # the test shows what failed
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "warnings": caught.messages}
    finally:
        logging.getLogger("autobatch.store").removeHandler(caught)


def run_autotune() -> int:
    model = build()
    plan = autobatch.autotune(
        model,
        torch.randn(1, 32),
        effective_batch_size=64,
        device="sim:8MiB",
        loss_fn=lambda output: output.mean(),
    )
    return plan.micro_batch_size * plan.gradient_accumulation_steps


def run_cli() -> int:
    out = io.StringIO()
    argv = ["tune", "__main__:build", "--input-shape", "32", "--device", "sim:8MiB"]
    argv += ["--effective-batch-size", "64", "--json"]
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, code
    plan = json.loads(out.getvalue())["plan"]
    return int(plan["micro_batch_size"] * plan["gradient_accumulation_steps"])


def run_finder() -> int:
    module = Regressor()
    finder = AutobatchFinder(64, device="sim:8MiB")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finder],
    )
    trainer.fit(module)
    return int(module.batch_size * trainer.accumulate_grad_batches)


def main_() -> None:
    uid = int(sys.argv[1])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    results: dict[str, Any] = {"uid": os.getuid(), "home": os.environ["HOME"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on CPU training
        road("autotune", run_autotune, results)
        road("cli", run_cli, results)
        road("finder", run_finder, results)
    print(json.dumps(results))


if __name__ == "__main__":
    main_()
