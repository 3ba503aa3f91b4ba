"""The drop-ins take ``activation_checkpointing``: the probe chooses the mode with the
micro-batch, and a mode other than ``"none"`` is switched on for training: the Hugging Face
Trainer's own arguments, a Lightning module's or an Accelerate model's blocks wrapped in place
(undone by ``remove_activation_checkpointing``). Under ``"none"`` nothing changes. Tiny GPT-2s
(random weights, no download) on simulated cards."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.errors import ConditionsWarning, ConfigError  # noqa: E402
from autobatch.probing import (  # noqa: E402
    apply_activation_checkpointing,
    checkpointed_blocks,
    remove_activation_checkpointing,
)

MIB = 2**20
SEQ_LEN = 16
FAST: dict[str, Any] = {"use_store": False}
"""No profile store: each test probes afresh."""


def _gpt2() -> Any:
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQ_LEN,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _ids(count: int) -> torch.Tensor:
    return torch.randint(0, 64, (count, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def _untouched(model: torch.nn.Module) -> bool:
    return not any("forward" in m.__dict__ for m in model.modules()) and not any(
        getattr(m, "gradient_checkpointing", False) for m in model.modules()
    )


# Hugging Face Trainer ------------------------------------------------------------------------


def _trainer(tmp_path: Path, **arguments: Any) -> Any:
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        **arguments,
    )
    rows = [{"input_ids": row, "labels": row} for row in _ids(32)]
    return transformers.Trainer(model=_gpt2(), args=args, train_dataset=rows)


@pytest.mark.parametrize(("mode", "every"), [("full", 1), ("selective", 2)])
def test_the_trainer_gets_its_own_switch_for_the_mode_chosen(
    tmp_path: Path, mode: str, every: int
) -> None:
    from autobatch.integrations.hf import autotune_trainer

    trainer = _trainer(tmp_path)
    plan = autotune_trainer(trainer, 16, device="sim:2MiB", activation_checkpointing=mode, **FAST)
    assert plan.activation_checkpointing == mode
    args = trainer.args
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"every_n_layers": every, "use_reentrant": False}
    assert _untouched(trainer.model)  # the Trainer turns it on in train(), not autobatch
    if mode == "selective":
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    blocks = [b.gradient_checkpointing for b in trainer.model.transformer.h]
    assert blocks == [True, True]
    # The probe's wrapping and the Trainer's flags are the same recompute: no false alarm.
    assert not [w for w in caught if issubclass(w.category, ConditionsWarning)]


def test_the_trainer_is_left_as_it_was_when_no_checkpointing_is_chosen(tmp_path: Path) -> None:
    from autobatch.integrations.hf import autotune_trainer

    trainer = _trainer(tmp_path)
    # One micro-step reaches the batch: no mode is tried, none is chosen.
    plan = autotune_trainer(trainer, 2, device="sim:4MiB", activation_checkpointing="auto", **FAST)
    assert plan.activation_checkpointing == "none"
    assert any("tried none; skipped selective, full" in note for note in plan.notes)
    assert not trainer.args.activation_checkpointing
    assert _untouched(trainer.model)


def test_a_trainer_that_checkpoints_already_is_not_asked_for_another_mode(
    tmp_path: Path,
) -> None:
    from autobatch.integrations.hf import autotune_trainer

    trainer = _trainer(tmp_path, activation_checkpointing=True)
    with pytest.raises(
        ConfigError,
        match=r"autotune_trainer got activation_checkpointing='auto', but the model checkpoints "
        r"activations already \(TrainingArguments\(activation_checkpointing=True\)\)",
    ):
        autotune_trainer(trainer, 16, device="sim:2MiB", activation_checkpointing="auto", **FAST)


# Lightning -----------------------------------------------------------------------------------


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _lightning_module(pl: Any) -> Any:
    class TinyLM(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()
            self.batch_size = 2

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            dataset = torch.utils.data.TensorDataset(_ids(32))
            return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)

    return TinyLM()


def _fit(pl: Any, module: Any, finder: Any) -> None:
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


@pytest.mark.usefixtures("quiet")
def test_the_finder_wraps_the_blocks_for_training_and_undoes_them() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from autobatch.integrations.lightning import AutobatchFinder

    module = _lightning_module(pl)
    finder = AutobatchFinder(16, device="sim:2MiB", activation_checkpointing="full", **FAST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(pl, module, finder)
    # Trained with the blocks as the probe measured them: the conditions check agrees.
    assert not [w for w in caught if issubclass(w.category, ConditionsWarning)]
    assert finder.plan is not None and finder.plan.activation_checkpointing == "full"
    assert checkpointed_blocks(module) == 2  # both GPT-2 blocks, as the probe measured them
    assert module.batch_size == finder.plan.micro_batch_size
    finder.undo_checkpointing()
    assert checkpointed_blocks(module) == 0 and _untouched(module)
    # Asked of a module that checkpoints already, it is refused by name.
    undo = apply_activation_checkpointing(module, "full")
    with pytest.raises(ConfigError, match="autobatch checkpoints 2 of its blocks"):
        _fit(pl, module, AutobatchFinder(16, device="sim:2MiB", activation_checkpointing="auto"))
    undo()


# Accelerate ----------------------------------------------------------------------------------


@pytest.fixture
def accelerator() -> Iterator[Any]:
    accelerate = pytest.importorskip("accelerate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield accelerate.Accelerator(cpu=True)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def test_accelerate_wraps_the_blocks_of_the_mode_chosen(accelerator: Any) -> None:
    from autobatch.integrations.accelerate import autotune_accelerator

    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = [{"input_ids": row, "labels": row} for row in _ids(32)]
    loader: Any = torch.utils.data.DataLoader(rows, batch_size=2)  # type: ignore[arg-type]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan = autotune_accelerator(
        accelerator,
        model,
        loader,
        16,
        optimizer=optimizer,
        device=SimulatedDevice(capacity_bytes=2 * MIB),
        activation_checkpointing="selective",
        **FAST,
    )
    assert plan.activation_checkpointing == "selective"
    wrapped = ["forward" in block.__dict__ for block in model.transformer.h]
    assert wrapped == [True, False]  # every 2nd block from the first, as the probe measured
    assert remove_activation_checkpointing(model) == 1
    assert _untouched(model)
    # Chosen "none" (one micro-step reaches the batch): the model is left as it was.
    plan = autotune_accelerator(
        accelerator,
        model,
        loader,
        2,
        optimizer=optimizer,
        device=SimulatedDevice(capacity_bytes=4 * MIB),
        activation_checkpointing="auto",
        **FAST,
    )
    assert plan.activation_checkpointing == "none"
    assert _untouched(model)
