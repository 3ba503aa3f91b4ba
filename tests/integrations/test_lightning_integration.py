"""AutobatchFinder with the real Lightning Trainer on the CPU and a simulated card: it sets the
batch size attribute and accumulate_grad_batches for an exact effective batch, the Trainer then
trains at those sizes, and the probe leaves no trace (a run with the finder ends with the same
weights as a run given the same sizes by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")
torchmetrics = pytest.importorskip("torchmetrics")

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.errors import ConditionsWarning, ConfigError, NoFeasiblePlanError  # noqa: E402
from autobatch.integrations.lightning import AutobatchFinder  # noqa: E402
from autobatch.store._store import ProfileStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
CAPACITY_BYTES = MIB * 3 // 10  # an MLP 32-256-10 with AdamW fits about 50 samples here


class Classifier(pl.LightningModule):
    """An MLP classifier whose train dataloader reads ``self.batch_size``; records what it saw."""

    def __init__(self, *, batch_size: int = 4, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        # A metric updated in training_step: the probe must leave it as it was, and its update
        # (bincount) cannot run on the estimator's fake tensors.
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
        self.batch_size = batch_size
        self.automatic_optimization = not manual
        self.seen: list[int] = []
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(4096, 32, generator=generator)
        self.targets = torch.randint(0, 10, (4096,), generator=generator)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.net(inputs)
        self.accuracy(logits, targets)
        loss = F.cross_entropy(logits, targets)
        self.log("train_loss", loss)  # fine in training, and during the probe
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            optimizer.step()  # type: ignore[union-attr]
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.seen.append(int(batch[0].shape[0]))  # Lightning's loop only, not the probe

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = torch.utils.data.TensorDataset(self.inputs, self.targets)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=True)


def make_trainer(*callbacks: Any, max_steps: int = 2, accumulate: int = 1) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    # Lightning warns about CPU training, few dataloader workers and the like.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_finder_sets_exact_sizes_and_the_trainer_trains_at_them() -> None:
    module = Classifier()
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES)
    trials: list[Any] = []
    finder = AutobatchFinder(96, device=device, use_store=False, on_trial=trials.append)
    trainer = make_trainer(finder, max_steps=2)
    torch.manual_seed(123)
    trainer.fit(module)

    plan = finder.plan
    assert plan is not None
    # The capacity binds: the max micro-batch is well below 96, so accumulation is needed.
    assert 1 < plan.max_micro_batch_size < 96
    assert plan.gradient_accumulation_steps > 1
    assert module.batch_size == plan.micro_batch_size
    assert trainer.accumulate_grad_batches == plan.gradient_accumulation_steps
    assert module.batch_size * trainer.accumulate_grad_batches * trainer.world_size == 96
    # Lightning trained 2 optimizer steps, each of k micro-batches of m samples.
    assert trainer.global_step == 2
    assert module.seen == [plan.micro_batch_size] * (2 * plan.gradient_accumulation_steps)
    # The fake-tensor estimate ran (metric updates off there): a few trials; doubling takes 11.
    # 11 in all under the search's rules: the warm-up at 1, nine search trials (the estimate's
    # 52 runs out of memory, its line is contradicted so the search goes on from what ran: 10,
    # 23, 30, 36, 41, 49, 50, each the split with the fewest expected OOMs that keeps every
    # answer within doubling's OOMs + 2, and 51 must fail to prove 50 the max) and the chosen
    # size's second step. Two OOMs.
    search = [t for t in trials if not t.warm_up and not t.repeat]
    assert len(search) <= 9
    assert sum(t.oom for t in search) <= 2
    assert [t.micro_batch_size for t in trials if t.warm_up or t.repeat] == [
        1,
        max(t.micro_batch_size for t in search if t.fits),
    ]
    assert len(trials) == len(search) + 2

    # Same run with the sizes given by hand: same weights, so the probe left nothing behind
    # (weights, optimizer state, RNG streams).
    by_hand = Classifier(batch_size=plan.micro_batch_size)
    torch.manual_seed(123)
    make_trainer(max_steps=2, accumulate=plan.gradient_accumulation_steps).fit(by_hand)
    assert by_hand.seen == module.seen
    for mine, theirs in zip(module.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert module.accuracy.update_count == by_hand.accuracy.update_count == len(module.seen)
    assert torch.equal(module.accuracy.compute(), by_hand.accuracy.compute())


def test_manual_optimization_gets_one_micro_batch_per_step() -> None:
    module = Classifier(manual=True)
    finder = AutobatchFinder(
        8, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False
    )
    trainer = make_trainer(finder, max_steps=2)
    trainer.fit(module)
    assert finder.plan is not None
    assert (module.batch_size, trainer.accumulate_grad_batches) == (8, 1)
    assert module.seen == [8, 8]


def test_manual_optimization_that_needs_accumulation_is_refused() -> None:
    module = Classifier(manual=True)
    finder = AutobatchFinder(
        1024, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False
    )
    with pytest.raises(NoFeasiblePlanError, match="1024.*at most 1 accumulation.*manual"):
        make_trainer(finder).fit(module)


def test_missing_batch_size_attribute_is_named() -> None:
    module = Classifier()
    del module.batch_size
    finder = AutobatchFinder(32, device="sim:64MiB", use_store=False)
    with pytest.raises(ConfigError, match="'batch_size'.*batch_arg_name"):
        make_trainer(finder).fit(module)


def test_dataloader_that_ignores_the_attribute_is_refused() -> None:
    class Fixed(Classifier):
        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            dataset = torch.utils.data.TensorDataset(self.inputs, self.targets)
            return torch.utils.data.DataLoader(dataset, batch_size=4)

    finder = AutobatchFinder(
        96, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False
    )
    with pytest.raises(ConfigError, match=r"batch size 4.*batch_size=self\.batch_size"):
        make_trainer(finder).fit(Fixed())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"world_size": 2}, "sets 'world_size' itself"),
        ({"uneven": "auto"}, "sets 'uneven' itself"),
        ({"safety_marjin": 0.1}, "unknown probe option 'safety_marjin'"),
        ({"eval": True}, "eval=True.*training_step only.*val_dataloader"),
        ({"mixed_ranks": True}, "AutobatchFinder cannot run mixed_ranks=True: Lightning"),
    ],
)
def test_options_the_finder_owns_or_does_not_know_are_refused(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        AutobatchFinder(64, **options)


def test_an_effective_batch_the_world_cannot_split_is_refused_before_probing() -> None:
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES)
    finder = AutobatchFinder(96, device=device, use_store=False, multiple_of=64)
    with pytest.raises(NoFeasiblePlanError, match="96.*multiples of 64.*64 below, 128 above"):
        make_trainer(finder).fit(Classifier())
    assert device.num_ooms == 0


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_smaller_card_and_train_at_the_plan(tmp_path: Path) -> None:
    # Rank 1's card is smaller: the plan must fit it, and both ranks must apply the same plan.
    smaller = AutobatchFinder(96, device=SimulatedDevice(capacity_bytes=MIB // 4), use_store=False)
    make_trainer(smaller, max_steps=1).fit(Classifier())
    assert smaller.plan is not None
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("lightning_ddp_worker.py")), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    plan = ranks[0]["plan"]
    assert plan["world_size"] == 2
    assert plan["max_micro_batch_size"] == smaller.plan.max_micro_batch_size
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["global_step"] == 2
        assert rank["batch_size"] * rank["accumulate_grad_batches"] * 2 == 96
        assert rank["seen"] == [plan["micro_batch_size"]] * (
            2 * plan["gradient_accumulation_steps"]
        )
    assert ranks[0]["first_weight"] == ranks[1]["first_weight"]  # DDP kept them in step


def test_the_batch_size_of_a_datamodule_is_set() -> None:
    class Data(pl.LightningDataModule):
        def __init__(self, source: Classifier) -> None:
            super().__init__()
            self.batch_size = 4
            self.dataset = torch.utils.data.TensorDataset(source.inputs, source.targets)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size)

    module = Classifier()
    del module.batch_size  # the datamodule holds it, as BatchSizeFinder also allows
    data = Data(module)
    finder = AutobatchFinder(
        96, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False
    )
    trainer = make_trainer(finder, max_steps=1)
    trainer.fit(module, datamodule=data)
    assert finder.plan is not None
    assert data.batch_size * trainer.accumulate_grad_batches == 96
    assert data.batch_size == finder.plan.micro_batch_size
    assert module.seen == [data.batch_size] * trainer.accumulate_grad_batches


def test_a_gradient_accumulation_scheduler_is_refused() -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trials: list[Any] = []
    finder = AutobatchFinder(
        96, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False,
        on_trial=trials.append,
    )  # fmt: skip
    trainer = make_trainer(finder, GradientAccumulationScheduler(scheduling={0: 2}))
    with pytest.raises(ConfigError, match="GradientAccumulationScheduler.*remove one"):
        trainer.fit(Classifier())
    assert trials == []  # refused before probing


def test_the_trainers_mixed_precision_is_probed(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profiles.sqlite3")
    finder = AutobatchFinder(96, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), store=store)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finder],
    )
    trainer.fit(Classifier())
    ((_, profile),) = store.list_profiles()
    assert profile.amp_dtype == "bfloat16"


class FreezesAtFitStart(Classifier):
    """Freezes its first layer in its own on_fit_start: after the finder's probe (callbacks'
    hooks run first), before training."""

    def on_fit_start(self) -> None:
        self.net[0].requires_grad_(False)


@pytest.mark.parametrize(("module", "warned"), [(Classifier, False), (FreezesAtFitStart, True)])
def test_the_plans_conditions_are_checked_when_training_starts(
    module: type[Classifier], warned: bool
) -> None:
    finder = AutobatchFinder(96, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(finder, max_steps=1).fit(module())
    said = [str(w.message) for w in caught if issubclass(w.category, ConditionsWarning)]
    if not warned:
        assert said == []
        return
    assert any(
        "AutobatchFinder: micro-batch" in text
        and "trainable parameters: measured with 11018 of 11018 trainable (100.0%)" in text
        for text in said
    ), said


class Linear1(pl.LightningModule):
    """One float64 weight w and the loss mean(x * w) over a micro-batch: its gradient is the
    mean of the micro-batch's x, so an SGD step of lr 1 moves w by minus the mean of the x the
    step saw, weighted as the step weights them."""

    def __init__(self, inputs: torch.Tensor, *, batch_size: int = 4) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.inputs = inputs
        self.batch_size = batch_size
        self.updates: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (batch[0] * self.w).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.updates.append(float(self.w.detach()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = torch.utils.data.TensorDataset(self.inputs)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)


def linear_trainer(*callbacks: Any, max_epochs: int = 1) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def test_the_epochs_short_last_step_is_the_exact_mean_of_its_samples() -> None:
    # 22 rows, 4 x 4 planned: an epoch is 4 micro-batches of 4 (one step), then one of 4 and a
    # partial one of 2 (a step of 6 samples). Lightning divides each loss by 4, so that step
    # would apply (mean(b5) + mean(b6)) / 4 unweighted: half the weight of its micro-batches,
    # and the partial one weighted as a whole one.
    inputs = -torch.arange(1, 23, dtype=torch.float64).unsqueeze(1) * 3
    module = Linear1(inputs)
    finder = AutobatchFinder(16, device="sim:64MiB", use_store=False, max_micro_batch_size=4)
    trainer = linear_trainer(finder)
    trainer.fit(module)
    assert finder.plan is not None and finder.plan.epoch is not None
    assert (finder.plan.micro_batch_size, finder.plan.gradient_accumulation_steps) == (4, 4)
    assert finder.plan.epoch.num_optimizer_steps == trainer.global_step == 2
    assert finder.plan.epoch.last_effective_batch_size == 6
    first, last = float(inputs[:16].mean()), float(inputs[16:].mean())
    assert module.updates[3] == pytest.approx(-first, abs=1e-12)
    assert module.updates[-1] == pytest.approx(-first - last, abs=1e-12)  # 25.5 + 58.5
    lightning_alone = (float(inputs[16:20].mean()) + float(inputs[20:].mean())) / 4
    assert lightning_alone == -30.0  # Lightning alone: 25.5 + 30, not 84


def test_the_weighting_warns_what_it_does(caplog: pytest.LogCaptureFixture) -> None:
    finder = AutobatchFinder(16, device="sim:64MiB", use_store=False, max_micro_batch_size=4)
    with caplog.at_level("WARNING", logger="autobatch.integrations"):
        linear_trainer(finder).fit(Linear1(torch.ones(22, 1, dtype=torch.float64)))
    (record,) = [r for r in caplog.records if "AutobatchFinder" in r.getMessage()]
    assert "an epoch is 6 micro-batches per rank (22 rows), 2 optimizer step(s)" in (
        record.getMessage()
    )
    assert "AutobatchFinder weights that step's micro-batches by their samples" in (
        record.getMessage()
    )


def test_an_epoch_shorter_than_one_step_is_refused_at_setup() -> None:
    # 125 rows, effective batch 256 as 8 x 32: every step of every epoch would see 125 samples.
    module = Linear1(torch.ones(125, 1, dtype=torch.float64))
    finder = AutobatchFinder(256, device="sim:64MiB", use_store=False, max_micro_batch_size=8)
    with pytest.raises(
        ConfigError,
        match=r"an epoch has 16 micro-batch\(es\) per rank \(num_training_batches\), fewer than "
        r"accumulate_grad_batches 32, so every optimizer step ends the epoch with an effective "
        r"batch of 125, never effective_batch_size 256",
    ):
        linear_trainer(finder).fit(module)
    assert module.updates == []


def test_without_an_effective_batch_the_finder_sets_the_largest_micro_batch() -> None:
    # BatchSizeFinder's question: the largest micro-batch, one per optimizer step.
    module = Classifier()
    trials: list[Any] = []
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES)
    finder = AutobatchFinder(device=device, use_store=False, on_trial=trials.append)
    trainer = make_trainer(finder, max_steps=1)
    trainer.fit(module)

    plan = finder.plan
    assert plan is not None
    fitted = max(t.micro_batch_size for t in trials if t.fits)
    assert plan.max_micro_batch_size <= fitted < 96  # the memory's edge bound it, not a batch
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (
        plan.max_micro_batch_size,
        1,
    )
    assert plan.effective_batch_size == plan.micro_batch_size * trainer.world_size
    assert module.batch_size == plan.micro_batch_size and trainer.accumulate_grad_batches == 1
    assert module.seen == [plan.micro_batch_size]
