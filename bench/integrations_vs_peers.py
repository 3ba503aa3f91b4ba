"""The framework drop-ins beside the frameworks' own finders, on one simulated card, in one run:

- **Lightning**: ``AutobatchFinder`` against ``BatchSizeFinder(mode="binsearch",
  init_val=<the module's batch size>)`` (otherwise its defaults: ``steps_per_trial=3``,
  ``margin=0.05``) as callbacks of the same Trainer settings, on fresh copies of the same
  LightningModule. ``init_val`` is the module's own batch size because with the default 2 the
  first trial runs at the module's batch size (the dataloader is built before the attribute is
  set) while BatchSizeFinder books it as 2.
- **Hugging Face**: ``autotune_trainer`` before ``trainer.train()`` against
  ``TrainingArguments(auto_find_batch_size=True)`` (Accelerate's ``find_executable_batch_size``
  halving from ``per_device_train_batch_size``) on the same Trainer setup.

The user asks for an effective batch E and starts from a configuration that reaches it
(micro-batch x accumulation = E) but does not fit the card. Each row says how many sizes each tool
tried, how many real training steps it ran to search (OOMs included), the micro-batch it settled
on, and the effective batch the run is left with (micro-batch x accumulation steps x world size):
the peers change the micro-batch and keep the accumulation steps, autobatch sets both.

Every real step of every tool runs under the simulated device's byte counter (Lightning: the
module's ``optimizer_step`` wraps training_step, backward and the optimizer step; HF: the Trainer's
``training_step`` and its optimizer's ``step``), then each run trains a few optimizer steps at the
sizes it chose, still counted, so an OOM in training shows. autobatch's probe counts its own steps
on the same device. The simulated device (``autobatch.SimulatedDevice``) runs on the CPU and raises
``torch.OutOfMemoryError`` when live tensor bytes exceed its capacity.

Usage::

    .venv/bin/python bench/integrations_vs_peers.py          # both frameworks, two cards each
    .venv/bin/python bench/integrations_vs_peers.py --quick  # one card each, E = 48
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
import warnings
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from autobatch import SimulatedDevice
from autobatch.device import is_oom
from autobatch.probing import BatchSource, batch_tensors, resident_tensors

MIB = 2**20
TRAIN_STEPS = 1
"""Optimizer steps each run trains at the sizes it chose, after its search."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Row:
    framework: str
    tool: str
    capacity_bytes: int
    start: str
    """The user's starting micro-batch x accumulation steps."""
    sizes: list[int] = dataclasses.field(default_factory=list)
    """Micro-batch sizes of the search's real steps, in order (repeats collapsed)."""
    search_steps: int = 0
    search_ooms: int = 0
    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    world_size: int = 1
    train_ooms: int = 0
    seconds: float = 0.0
    note: str = ""

    @property
    def effective_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size


def _collapse(sizes: list[int]) -> list[int]:
    return [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n]


class _Quiet:
    """Lightning and transformers log and warn about CPU training, workers and the like."""

    def __enter__(self) -> None:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore")
        self._levels = {}
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
            lg = logging.getLogger(name)
            self._levels[name] = lg.level
            lg.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._catch.__exit__(*exc)


# -- Lightning -----------------------------------------------------------------------------------


def _lightning_module(device: SimulatedDevice, *, batch_size: int) -> Any:
    """A tiny GPT-2 LightningModule (automatic optimization) on random token batches; every step
    Lightning runs is counted on ``device``; ``phase`` says whether the search or training runs."""
    import lightning.pytorch as pl

    from bench._cases import _gpt2

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = _gpt2(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
            self.batch_size = batch_size
            self.phase = "search"
            self.sizes: dict[str, list[int]] = {"search": [], "train": []}
            self.ooms = {"search": 0, "train": 0}
            ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
            self.source = BatchSource.from_sample({"input_ids": ids, "labels": ids})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            # Lightning's closure runs training_step and backward inside optimizer.step().
            optimizer = self.trainer.optimizers[0]
            resident = [*resident_tensors(self, optimizer), *batch_tensors(self._batch)]
            try:
                with device.measure(resident):
                    super().optimizer_step(*args, **kwargs)
            except Exception as exc:
                if is_oom(exc):
                    self.ooms[self.phase] += 1
                raise

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._batch = batch
            self.sizes[self.phase].append(int(batch["input_ids"].shape[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(
                range(1 << 16),
                batch_size=self.batch_size,
                collate_fn=lambda rows: self.source.make(len(rows)),
            )

    return Module()


def run_lightning(
    tool: str, capacity_bytes: int, *, effective_batch_size: int, start_micro: int
) -> Row:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder

    from autobatch.integrations.lightning import AutobatchFinder

    device = SimulatedDevice(capacity_bytes=capacity_bytes)
    accumulation = effective_batch_size // start_micro
    module = _lightning_module(device, batch_size=start_micro)
    probe_trials: list[Any] = []
    finder: Any
    if tool == "autobatch":
        finder = AutobatchFinder(
            effective_batch_size, device=device, use_store=False, on_trial=probe_trials.append
        )
    else:
        finder = BatchSizeFinder(mode="binsearch", init_val=start_micro)

    class Phase(pl.Callback):  # after the finder: its on_fit_start runs once the search is done
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pl_module.phase = "train"

    row = Row(
        framework="lightning",
        tool="AutobatchFinder" if tool == "autobatch" else "BatchSizeFinder",
        capacity_bytes=capacity_bytes,
        start=f"{start_micro}x{accumulation}",
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root, _Quiet():
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=TRAIN_STEPS,
            accumulate_grad_batches=accumulation,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[finder, Phase()],
        )
        try:
            trainer.fit(module)
        except torch.OutOfMemoryError:
            row.note = "OOM in training"
    row.seconds = time.perf_counter() - started
    if tool == "autobatch":
        row.sizes = _collapse([t.micro_batch_size for t in probe_trials])
        row.search_steps = len(probe_trials)
        row.search_ooms = sum(t.oom for t in probe_trials)
    else:
        row.sizes = _collapse(module.sizes["search"])
        row.search_steps = len(module.sizes["search"])
        row.search_ooms = module.ooms["search"]
    row.micro_batch_size = module.batch_size
    row.gradient_accumulation_steps = trainer.accumulate_grad_batches
    row.world_size = trainer.world_size
    row.train_ooms = module.ooms["train"]
    return row


# -- Hugging Face --------------------------------------------------------------------------------


def _hf_trainer(device: SimulatedDevice, root: str, *, per_device: int, accumulation: int,
                auto_find: bool) -> Any:  # fmt: skip
    """A tiny GPT-2 Trainer on random 32-token rows; its training steps and optimizer steps are
    counted on ``device`` once ``measuring`` is set (after autobatch's probe, which counts its
    own)."""
    import transformers

    from bench._cases import _gpt2

    class MeasuredTrainer(transformers.Trainer):  # type: ignore[misc]
        measuring = False
        phase = "search"
        sizes: list[tuple[int, bool]]
        ooms = 0

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            if not self.measuring:
                return super().training_step(model, inputs, num_items_in_batch)
            resident = [*resident_tensors(model, self.optimizer), *batch_tensors(inputs)]
            self.sizes.append((int(inputs["input_ids"].shape[0]), False))
            try:
                with device.measure(resident):
                    return super().training_step(model, inputs, num_items_in_batch)
            except Exception as exc:
                if is_oom(exc):
                    self.ooms += 1
                    self.sizes[-1] = (self.sizes[-1][0], True)
                raise

        def create_optimizer(self, model: Any = None) -> Any:
            optimizer = super().create_optimizer(model)
            if self.measuring and not getattr(optimizer, "_measured", False):
                inner = getattr(optimizer, "optimizer", optimizer)
                step = inner.step

                def measured_step(*args: Any, **kwargs: Any) -> Any:
                    with device.measure(resident_tensors(self.model, inner)):
                        return step(*args, **kwargs)

                inner.step = measured_step
                optimizer._measured = True
            return optimizer

    torch.manual_seed(0)
    model = _gpt2(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 256, (32,), generator=generator)} for _ in range(2048)]
    args = transformers.TrainingArguments(
        output_dir=root,
        use_cpu=True,
        max_steps=TRAIN_STEPS,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        auto_find_batch_size=auto_find,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = MeasuredTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=lambda batch: {
            "input_ids": torch.stack([r["input_ids"] for r in batch]),
            "labels": torch.stack([r["input_ids"] for r in batch]),
        },
    )
    trainer.sizes = []
    return trainer


def run_hf(tool: str, capacity_bytes: int, *, effective_batch_size: int, start_micro: int) -> Row:
    from autobatch.integrations.hf import autotune_trainer

    device = SimulatedDevice(capacity_bytes=capacity_bytes)
    accumulation = effective_batch_size // start_micro
    row = Row(
        framework="hf",
        tool="autotune_trainer" if tool == "autobatch" else "auto_find_batch_size",
        capacity_bytes=capacity_bytes,
        start=f"{start_micro}x{accumulation}",
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root, _Quiet():
        trainer = _hf_trainer(
            device,
            root,
            per_device=start_micro,
            accumulation=accumulation,
            auto_find=tool != "autobatch",
        )
        if tool == "autobatch":
            trials: list[Any] = []
            autotune_trainer(
                trainer, effective_batch_size, device=device, use_store=False,
                on_trial=trials.append,
            )  # fmt: skip
            row.sizes = _collapse([t.micro_batch_size for t in trials])
            row.search_steps = len(trials)
            row.search_ooms = sum(t.oom for t in trials)
        trainer.measuring = True
        try:
            trainer.train()
        except torch.OutOfMemoryError:
            row.note = "OOM in training"
        if tool != "autobatch":
            # Every step at a size that later ran out of memory (that OOM included) is search.
            final = trainer._train_batch_size
            search = [(n, oom) for n, oom in trainer.sizes if n != final]
            row.sizes = _collapse([n for n, _ in trainer.sizes])
            row.search_steps = len(search)
            row.search_ooms = sum(oom for _, oom in search)
            row.train_ooms = sum(oom for n, oom in trainer.sizes if n == final)
        else:
            row.train_ooms = trainer.ooms
    row.seconds = time.perf_counter() - started
    row.micro_batch_size = trainer._train_batch_size  # what train() ran with
    row.gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    row.world_size = trainer.args.world_size
    return row


# -- display -------------------------------------------------------------------------------------


def format_rows(rows: list[Row], effective_batch_size: int) -> str:
    header = (
        f"{'framework':<9} {'card':>8} {'tool':<21} {'start':>6} {'trials':>6} {'steps':>5} "
        f"{'OOMs':>4} {'micro':>5} {'accum':>5} {'eff.batch':>9} {'exact':>5} {'train OOMs':>10} "
        f"{'s':>6}  sizes tried"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        sizes = ",".join(map(str, r.sizes[:16])) + ("..." if len(r.sizes) > 16 else "")
        exact = "yes" if r.effective_batch_size == effective_batch_size else "NO"
        lines.append(
            f"{r.framework:<9} {r.capacity_bytes / MIB:>5.3g}MiB {r.tool:<21} {r.start:>6} "
            f"{len(r.sizes):>6} {r.search_steps:>5} {r.search_ooms:>4} {r.micro_batch_size:>5} "
            f"{r.gradient_accumulation_steps:>5} {r.effective_batch_size:>9} {exact:>5} "
            f"{r.train_ooms:>10} {r.seconds:>6.1f}  {sizes}" + (f"  ({r.note})" if r.note else "")
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one card per framework, effective batch 48 from 48x1 (unless given)",
    )
    parser.add_argument(
        "--effective-batch-size", type=int, default=None, help="E the user asks for (default 192)"
    )
    parser.add_argument(
        "--start-micro", type=int, default=None, help="the user's first micro-batch (default 96)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.effective_batch_size is None:
        args.effective_batch_size = 48 if args.quick else 192
    if args.start_micro is None:
        args.start_micro = 48 if args.quick else 96
    torch.set_num_threads(args.threads)
    if args.effective_batch_size % args.start_micro:
        print("--start-micro must divide --effective-batch-size", file=sys.stderr)
        return 2
    capacities = [16 * MIB, 32 * MIB]
    if args.quick:
        capacities = capacities[:1]
    started = time.perf_counter()
    rows: list[Row] = []
    for framework, run in (("lightning", run_lightning), ("hf", run_hf)):
        for capacity in capacities:
            for tool in ("autobatch", "peer"):
                print(
                    f"{framework} {tool} @ {capacity / MIB:g}MiB ...", file=sys.stderr, flush=True
                )
                rows.append(
                    run(
                        tool,
                        capacity,
                        effective_batch_size=args.effective_batch_size,
                        start_micro=args.start_micro,
                    )
                )
    print()
    print(
        f"Effective batch asked: {args.effective_batch_size}; tiny GPT-2 (2 layers, 64 wide, 32 "
        "tokens), AdamW, on a simulated card (real steps on the CPU, OOM over the capacity). "
        "trials = sizes tried; steps = real training steps of the search (OOMs included); "
        f"then {TRAIN_STEPS} optimizer step(s) of training at the chosen sizes (train OOMs)."
    )
    print(format_rows(rows, args.effective_batch_size))
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
