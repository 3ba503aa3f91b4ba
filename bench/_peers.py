"""Shared by ``bench/probe_vs_peers.py`` and ``bench/gpu_check.py``: model cases, and one runner per
tool that searches for the largest micro-batch: autobatch's probe, PyTorch Lightning's
``BatchSizeFinder`` (``mode="binsearch"``), Hugging Face Accelerate's
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
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import autobatch
from autobatch.device import Device, is_oom
from autobatch.probing import BatchSource, LossFn, TrainingStep, batch_tensors
from autobatch.profile import Profile

__all__ = [
    "Case",
    "ToolResult",
    "TINY_CASES",
    "format_table",
    "median",
    "run_accelerate",
    "run_autobatch",
    "run_bisection",
    "exhaustive_at",
    "run_exhaustive",
    "run_lightning",
    "summarize",
]

GIB = 2**30
MIB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """A model, its sample and how its step is formed; :meth:`build` gives fresh, seeded copies."""

    name: str
    build_model: Callable[[], torch.nn.Module]
    build_sample: Callable[[], Any]
    """Returns one sample batch on the CPU (a few rows; micro-batches tile it)."""
    loss_fn: LossFn | None = None
    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = lambda m: (
        torch.optim.AdamW(m.parameters())
    )
    capacities_bytes: tuple[int, ...] = ()
    """Simulated capacities this case is benchmarked at (tiny cases only)."""

    def build(self, device: torch.device) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
        """Model (on ``device``), sample (on ``device``) and optimizer, seeded identically."""
        torch.manual_seed(0)
        model = self.build_model().to(device)
        sample = _to(self.build_sample(), device)
        return model, sample, self.build_optimizer(model)


def _to(batch: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch
    )


# -- model cases ---------------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config notes such as "loss_type=None ... unrecognized"


def _gpt2(**config: Any) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    # Token ids of the default config lie outside a tiny vocabulary; unset them.
    return GPT2LMHeadModel(GPT2Config(bos_token_id=None, eos_token_id=None, **config))


def _bert(**config: Any) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**config))


def _vit(**config: Any) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(**config))


def _tokens(rows: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length))
    return {"input_ids": ids, "labels": ids}


def _classified_tokens(rows: int, length: int, vocab: int, labels: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, vocab, (rows, length)),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": torch.randint(0, labels, (rows,)),
    }


TINY_CASES: tuple[Case, ...] = (
    # Same models and samples as tests/conftest.py's MODEL_CASES. Capacities are round numbers
    # (not derived from the estimator) giving maxima of roughly 20 and 50 (MLP: 52 and 117).
    Case(
        name="mlp-adam",
        build_model=_mlp,
        build_sample=lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))),
        loss_fn=F.cross_entropy,
        build_optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        capacities_bytes=(MIB * 3 // 10, MIB // 2),
    ),
    Case(
        name="cnn-batchnorm",
        build_model=_cnn,
        build_sample=lambda: (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))),
        loss_fn=F.cross_entropy,
        build_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        capacities_bytes=(2 * MIB, 5 * MIB),
    ),
    Case(
        name="gpt2-tiny",
        build_model=lambda: _gpt2(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64),
        build_sample=lambda: _tokens(2, 32, 256),
        capacities_bytes=(16 * MIB, 32 * MIB),
    ),
    Case(
        name="bert-tiny",
        build_model=lambda: _bert(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
            num_labels=3,
        ),
        build_sample=lambda: _classified_tokens(2, 32, 256, 3),
        capacities_bytes=(8 * MIB, 16 * MIB),
    ),
    Case(
        name="vit-tiny",
        build_model=lambda: _vit(
            image_size=32,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            num_labels=10,
        ),
        build_sample=lambda: {
            "pixel_values": torch.randn(2, 3, 32, 32),
            "labels": torch.randint(0, 10, (2,)),
        },
        capacities_bytes=(4 * MIB, 8 * MIB),
    ),
)


def real_cases(seq_len: int = 512) -> tuple[Case, ...]:
    """Real-size models with random weights (for a GPU): GPT-2 124M and BERT-base at ``seq_len``."""
    return (
        Case(
            name=f"gpt2-124m@{seq_len}",
            build_model=lambda: _gpt2(n_positions=max(1024, seq_len)),
            build_sample=lambda: _tokens(2, seq_len, 50257),
        ),
        Case(
            name=f"bert-base@{seq_len}",
            build_model=lambda: _bert(max_position_embeddings=max(512, seq_len), num_labels=2),
            build_sample=lambda: _classified_tokens(2, seq_len, 30522, 2),
        ),
    )


# -- results -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """One tool's search on one (case, capacity)."""

    tool: str
    """``"autobatch"``, ``"lightning"``, ``"accelerate"`` or ``"exhaustive"``."""
    micro_batch_size: int
    """The largest micro-batch the tool reports as fitting (0: none found)."""
    num_trials: int
    """Distinct real sizes tried (warm-up included where the tool runs one)."""
    num_steps: int
    """Real training steps run, including those that ran out of memory."""
    num_ooms: int
    """Steps that ran out of memory."""
    seconds: float
    """Time of the whole search on the device's clock (autobatch: its fake-tensor estimate
    included; the model's construction and the release after it excluded)."""
    sizes: tuple[int, ...] = ()
    """Sizes tried, in order."""
    peak_bytes: tuple[int, ...] = ()
    """Exhaustive only: measured peak of each size from 1 up that fitted."""
    note: str = ""


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


# -- display -------------------------------------------------------------------------------------

TOOLS = ("autobatch", "lightning", "accelerate")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _ratio(found: int, reference: int) -> float:
    return found / reference if reference > 0 else float("nan")


def format_capacity(capacity_bytes: int) -> str:
    if capacity_bytes >= GIB:
        return f"{capacity_bytes / GIB:.0f}GiB"
    return f"{capacity_bytes / MIB:.3g}MiB"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (case, capacity, tool); ``rows`` items have ``case``, ``capacity_bytes``,
    ``exhaustive`` (a ToolResult) and one ToolResult per tool in :data:`TOOLS`."""
    header = (
        f"{'model':<16} {'capacity':>9} {'tool':<11} {'found':>6} {'exh.max':>7} {'ratio':>6} "
        f"{'trials':>6} {'steps':>6} {'OOMs':>5} {'seconds':>8}  sizes tried"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        reference: ToolResult = row["exhaustive"]
        for tool in (*TOOLS, "exhaustive"):
            result: ToolResult | None = row.get(tool)
            if result is None:
                continue
            sizes = ",".join(map(str, result.sizes[:14])) + (
                "..." if len(result.sizes) > 14 else ""
            )
            if result.note:
                sizes = f"{sizes}  ({result.note})" if sizes else f"({result.note})"
            lines.append(
                f"{row['case']:<16} {format_capacity(row['capacity_bytes']):>9} {tool:<11} "
                f"{result.micro_batch_size:>6} {reference.micro_batch_size:>7} "
                f"{_ratio(result.micro_batch_size, reference.micro_batch_size):>6.3f} "
                f"{result.num_trials:>6} {result.num_steps:>6} {result.num_ooms:>5} "
                f"{result.seconds:>8.2f}  {sizes}"
            )
    return "\n".join(lines)


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians per tool over the rows: trials, steps, OOMs, found/exhaustive ratio, seconds."""
    summary: dict[str, dict[str, float]] = {}
    for tool in TOOLS:
        results = [(row[tool], row["exhaustive"]) for row in rows if row.get(tool) is not None]
        summary[tool] = {
            "median_trials": median([r.num_trials for r, _ in results]),
            "median_steps": median([r.num_steps for r, _ in results]),
            "median_ooms": median([r.num_ooms for r, _ in results]),
            "median_ratio": median(
                [_ratio(r.micro_batch_size, e.micro_batch_size) for r, e in results]
            ),
            "min_ratio": min(
                (_ratio(r.micro_batch_size, e.micro_batch_size) for r, e in results),
                default=float("nan"),
            ),
            "median_seconds": median([r.seconds for r, _ in results]),
        }
    return summary


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    parts = [
        f"{tool}: trials {s['median_trials']:g}, steps {s['median_steps']:g}, "
        f"OOMs {s['median_ooms']:g}, found/max {s['median_ratio']:.3f} (min {s['min_ratio']:.3f}), "
        f"{s['median_seconds']:.2f} s"
        for tool, s in summary.items()
    ]
    return "medians | " + " | ".join(parts)
