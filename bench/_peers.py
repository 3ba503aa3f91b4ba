"""Shared by ``bench/probe_vs_peers.py`` and ``bench/gpu_check.py``: one runner per tool that
searches for the largest micro-batch (the model cases are ``bench/_cases.py``'s, the results
and their tables ``bench/_results.py``'s, both re-exported here): autobatch's probe, PyTorch
Lightning's ``BatchSizeFinder`` (``mode="binsearch"``), Hugging Face Accelerate's
``find_executable_batch_size``, and the exhaustive reference (every size from 1 up, as
``tests/conftest.py``'s ``exhaustive_max``; that file imports pytest, which a GPU box may lack).

Every tool runs the same real step on a fresh, seeded copy of the same model: forward, loss,
backward, optimizer step (with the optimizer state present), ``zero_grad``, measured under the
device's ``measure(...)`` context, so a :class:`~autobatch.SimulatedDevice` raises
``torch.OutOfMemoryError`` for all of them alike, and a CUDA device raises its real OOM.

How each peer is wired, and why:

- **Lightning** runs ``Tuner.scale_batch_size(mode="binsearch")`` (the real ``BatchSizeFinder``:
  doubling from ``init_val=2``, then bisection; ``steps_per_trial=3``) on a ``LightningModule``
  that wraps the model with manual optimization, so the whole step (including backward and
  ``optimizer.step()``, where many OOMs happen) runs inside ``training_step`` under the device's
  ``measure``. ``margin=0.0``: Lightning's default 5% margin would shrink the answer below the
  largest size it found; autobatch reports its margin separately (recommended size).
  Lightning's ``is_oom_error`` only accepts a ``RuntimeError`` whose message holds both "CUDA"
  and "out of memory" (or the CPU allocator's text); the simulated device's message opens like
  the CUDA allocator's ("CUDA out of memory. Tried to allocate ..."), so it passes unchanged.
- **Accelerate** decorates a function that runs one step at the given size;
  ``should_reduce_batch_size`` recognises any ``RuntimeError`` with " out of memory." in its
  message, which the simulated device's message has, so nothing is wrapped. One warm-up step at
  micro-batch 1 creates the optimizer state first (counted as a trial and a step, as autobatch
  counts its own warm-up): without it a first step at size n would pass without Adam's moments
  and the answer could OOM in training.

Example::

    device = SimulatedDevice(capacity_bytes=16 * 2**20)
    result = run_lightning(TINY_CASES[0], device, accelerator="cpu")
    result.num_steps, result.micro_batch_size
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

import autobatch
from autobatch.device import Device, is_oom
from autobatch.probing import BatchSource, TrainingStep, batch_tensors
from autobatch.profile import Profile
from bench._cases import GIB, MIB, TINY_CASES, Case, real_cases
from bench._results import (
    ToolResult,
    format_capacity,
    format_summary,
    format_table,
    median,
    summarize,
)

__all__ = [
    "GIB",
    "MIB",
    "TINY_CASES",
    "Case",
    "ToolResult",
    "exhaustive_at",
    "format_capacity",
    "format_summary",
    "format_table",
    "median",
    "real_cases",
    "run_accelerate",
    "run_autobatch",
    "run_bisection",
    "run_exhaustive",
    "run_lightning",
    "summarize",
]


def _resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors alive before a step: weights, buffers, gradients, optimizer state."""
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *grads, *state]


def _release(device: Device) -> None:
    gc.collect()
    device.release()


# -- autobatch -----------------------------------------------------------------------------------


def run_autobatch(
    case: Case, device: Device, *, max_micro_batch_size: int = 1 << 16
) -> tuple[ToolResult, Profile]:
    """``autobatch.probe`` with the case's optimizer (state restored afterwards)."""
    model, sample, optimizer = case.build(device.torch_device)
    started = device.clock()
    profile = autobatch.probe(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=case.loss_fn,
        device=device,
        max_micro_batch_size=max_micro_batch_size,
    )
    seconds = device.clock() - started
    del model, sample, optimizer
    _release(device)
    result = ToolResult(
        tool="autobatch",
        micro_batch_size=profile.max_micro_batch_size,
        num_trials=profile.num_trials,
        num_steps=profile.num_steps,
        num_ooms=profile.num_ooms,
        seconds=seconds,
        sizes=tuple(t.micro_batch_size for t in profile.trials),
        note=profile.method,
    )
    return result, profile


# -- plain bisection -----------------------------------------------------------------------------


def run_bisection(case: Case, device: Device, *, limit: int) -> ToolResult:
    """Bisection over ``1..limit`` with real steps after a warm-up at 1 (optimizer state created):
    the floor of what a search without an estimate costs, ``ceil(log2(limit))`` trials. Any
    exception counts as a failure (exact for a failure pattern monotone in the size)."""
    model, sample, optimizer = case.build(device.torch_device)
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    started = device.clock()
    sizes, num_ooms = [1], 0
    with device.measure(_resident(model, optimizer)):
        step.run(source.make(1))

    def runs(size: int) -> bool:
        nonlocal num_ooms
        sizes.append(size)
        try:
            with device.measure(_resident(model, optimizer)):
                step.run(source.make(size))
                device.synchronize()
        except Exception as exc:  # any failure bounds the sizes that run
            num_ooms += is_oom(exc)
            for param in model.parameters():
                param.grad = None
            device.release()
            return False
        return True

    lo, hi = 1, limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if runs(mid) else (lo, mid)
    seconds = device.clock() - started
    model = sample = optimizer = step = source = None  # type: ignore[assignment]
    _release(device)
    return ToolResult(
        tool="bisection",
        micro_batch_size=lo,
        num_trials=len(sizes),
        num_steps=len(sizes),
        num_ooms=num_ooms,
        seconds=seconds,
        sizes=tuple(sizes),
    )


# -- exhaustive ----------------------------------------------------------------------------------


def run_exhaustive(
    case: Case, device: Device, *, limit: int = 4096, deadline: float | None = None
) -> ToolResult:
    """Largest n such that every size 1..n fits, trying each in turn (as ``exhaustive_max``).

    A warm-up step at size 1 creates the optimizer state first. When ``deadline`` (a
    ``time.perf_counter()`` value) passes, the scan stops and the result is a lower bound (noted).
    """
    model, sample, optimizer = case.build(device.torch_device)
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    started = time.perf_counter()
    step.run(source.make(1))  # optimizer state present from here on
    largest, num_steps, num_ooms, note = 0, 1, 0, ""
    peaks: list[int] = []
    for size in range(1, limit + 1):
        if deadline is not None and time.perf_counter() > deadline:
            note = f"cut by the time budget: >= {largest}"
            break
        num_steps += 1
        oom = False
        try:
            with device.measure(_resident(model, optimizer)) as peak:
                step.run(source.make(size))
                device.synchronize()
        except Exception as exc:
            if not is_oom(exc):
                raise
            oom = True
        if oom:
            num_ooms += 1
            break
        largest = size
        peaks.append(peak.reserved_bytes)
    seconds = time.perf_counter() - started
    del model, sample, optimizer, step, source
    _release(device)
    return ToolResult(
        tool="exhaustive",
        micro_batch_size=largest,
        num_trials=num_steps - 1,
        num_steps=num_steps,
        num_ooms=num_ooms,
        seconds=seconds,
        peak_bytes=tuple(peaks),
        note=note,
    )


def exhaustive_at(scan: ToolResult, capacity_bytes: int) -> ToolResult:
    """The exhaustive max at a smaller simulated capacity, from a scan at a larger one.

    Exact on the simulated device: a step's allocations do not depend on the capacity, and it
    raises OOM exactly when its peak would exceed the capacity, so size n fits at
    ``capacity_bytes`` iff its peak measured at the larger capacity is <= ``capacity_bytes``.
    """
    largest = 0
    for peak in scan.peak_bytes:
        if peak > capacity_bytes:
            break
        largest += 1
    if largest == len(scan.peak_bytes):
        return scan
    return dataclasses.replace(
        scan,
        micro_batch_size=largest,
        num_trials=largest + 1,
        num_steps=largest + 2,
        num_ooms=1,
        peak_bytes=scan.peak_bytes[:largest],
        note="from the scan at the larger capacity",
    )


# -- Hugging Face Accelerate ---------------------------------------------------------------------


def run_accelerate(case: Case, device: Device, *, starting_micro_batch_size: int) -> ToolResult:
    """``accelerate.utils.find_executable_batch_size`` over one real step per call."""
    from accelerate.utils.memory import find_executable_batch_size, should_reduce_batch_size

    model, sample, optimizer = case.build(device.torch_device)
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    sizes: list[int] = []
    num_ooms = 0
    started = device.clock()
    with device.measure(_resident(model, optimizer)):  # a step on the device's clock too
        step.run(source.make(1))  # warm-up: creates the optimizer state (see module docstring)
    sizes.append(1)

    def one_step(micro_batch_size: int) -> int:
        nonlocal num_ooms
        sizes.append(micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        try:
            with device.measure(_resident(model, optimizer)):
                step.run(source.make(micro_batch_size))
                device.synchronize()
        except Exception as exc:
            if should_reduce_batch_size(exc):
                num_ooms += 1
            raise
        return micro_batch_size

    try:
        found = find_executable_batch_size(
            one_step, starting_batch_size=starting_micro_batch_size
        )()
        note = f"start {starting_micro_batch_size}"
    except RuntimeError as exc:
        if "No executable batch size found" not in str(exc):
            raise
        found, note = 0, "no size fits"
    seconds = device.clock() - started
    # Drop the references (the closure holds them too) so a CUDA cache can be emptied.
    model = sample = optimizer = step = source = None  # type: ignore[assignment]
    _release(device)
    return ToolResult(
        tool="accelerate",
        micro_batch_size=found,
        num_trials=len(sizes),
        num_steps=len(sizes),
        num_ooms=num_ooms,
        seconds=seconds,
        sizes=tuple(sizes),
        note=note,
    )


# -- PyTorch Lightning ---------------------------------------------------------------------------


class _IndexDataset(torch.utils.data.Dataset[int]):
    """Indices only; the collate function builds the micro-batch from the case's sample."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning logs every trial at INFO and warns about CPU training, dataloader workers and
    the like; none of it is about the comparison."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_lightning(
    case: Case,
    device: Device,
    *,
    accelerator: str,
    steps_per_trial: int = 3,
    dataset_length: int = 1 << 20,
) -> ToolResult:
    """``Tuner(trainer).scale_batch_size(mode="binsearch", margin=0.0)`` on the case's model.

    Args:
        accelerator: ``"cpu"`` (simulated device) or ``"gpu"`` (CUDA device ``device``).
        steps_per_trial: Lightning's default is 3.
        dataset_length: large, so Lightning never stops at "batch size >= dataset length".
    """
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    model, sample, _ = case.build(torch.device("cpu"))  # Lightning moves the module itself
    source = BatchSource.from_sample(sample)
    sizes: list[int] = []
    counts = {"ooms": 0}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.batch_size = 2  # Lightning overwrites it before each trial
            self.automatic_optimization = False  # the whole step runs in training_step
            self.step: TrainingStep | None = None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return case.build_optimizer(self.model)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(
                _IndexDataset(dataset_length),
                batch_size=self.batch_size,
                collate_fn=lambda indices: source.make(len(indices)),
            )

        def training_step(self, batch: Any, batch_idx: int) -> None:
            lightning_optimizer = self.optimizers()
            assert not isinstance(lightning_optimizer, list)
            optimizer = lightning_optimizer.optimizer
            if self.step is None:
                self.step = TrainingStep(self.model, optimizer, loss_fn=case.loss_fn)
            sizes.append(batch_tensors(batch)[0].shape[0])
            optimizer.zero_grad(set_to_none=True)
            resident = [*_resident(self.model, optimizer), *batch_tensors(batch)]
            try:
                with device.measure(resident):
                    loss = self.step.loss(batch)
                    self.manual_backward(loss)
                    del loss
                    lightning_optimizer.step()
                    lightning_optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
            except Exception as exc:
                if not is_oom(exc):
                    raise
                counts["ooms"] += 1
                raise

    module = Module()
    started = device.clock()
    with tempfile.TemporaryDirectory() as root, _quiet_lightning():
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=[device.torch_device.index or 0] if accelerator == "gpu" else 1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        found = Tuner(trainer).scale_batch_size(
            module, mode="binsearch", steps_per_trial=steps_per_trial, margin=0.0
        )
    seconds = device.clock() - started
    del module, trainer
    model = sample = source = None  # type: ignore[assignment]  # the closures hold them too
    _release(device)
    return ToolResult(
        tool="lightning",
        micro_batch_size=int(found or 0),
        num_trials=sum(1 for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n),
        num_steps=len(sizes),
        num_ooms=counts["ooms"],
        seconds=seconds,
        sizes=tuple(n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n),
    )
