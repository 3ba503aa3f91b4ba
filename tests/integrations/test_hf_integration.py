"""autotune_trainer with the real Hugging Face Trainer on the CPU and a simulated card: it probes
the Trainer's model with its collator's longest batch, its loss and its optimizer, sets
per_device_train_batch_size and gradient_accumulation_steps for an exact effective batch, and the
Trainer then trains at those sizes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from autobatch.device._simulated import SimulatedDevice  # noqa: E402
from autobatch.errors import ConditionsWarning, ConfigError, NoFeasiblePlanError  # noqa: E402
from autobatch.integrations.hf import autotune_trainer, row_length  # noqa: E402
from autobatch.store._store import ProfileStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
CAPACITY_BYTES = 24 * MIB  # GPT-2 tiny with AdamW fits about 10 rows of 48 tokens here
LONGEST = 48


def tiny_gpt2() -> Any:
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def token_rows(count: int = 64) -> list[dict[str, list[int]]]:
    """Rows of 8 to 24 tokens, and one of LONGEST tokens (row 37)."""
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(8, 25, (count,), generator=generator).tolist()
    lengths[37] = LONGEST
    return [
        {"input_ids": torch.randint(0, 256, (n,), generator=generator).tolist()} for n in lengths
    ]


def pad_collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Pads to the longest row; labels are -100 on padding."""
    width = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_trainer(tmp_path: Path, *, num_rows: int = 96, **arguments: Any) -> Any:
    arguments = {"max_steps": 2, "per_device_train_batch_size": 2, **arguments}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **arguments,
    )
    return transformers.Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=token_rows(num_rows),
        data_collator=pad_collate,
    )


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_autotune_trainer_sets_exact_sizes_and_the_trainer_trains_at_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(tmp_path)  # 96 rows: two whole optimizer steps of 48
    store = ProfileStore(tmp_path / "profiles.sqlite3")
    plan = autotune_trainer(
        trainer, 48, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), store=store
    )
    # The capacity binds at 48 tokens, so accumulation is needed.
    assert 1 < plan.max_micro_batch_size < 48
    assert plan.gradient_accumulation_steps > 1
    assert trainer.args.per_device_train_batch_size == plan.micro_batch_size
    assert trainer.args.gradient_accumulation_steps == plan.gradient_accumulation_steps
    assert trainer.get_total_train_batch_size(trainer.args) == 48
    # The probe ran on the collator's batch of the longest rows.
    ((_, profile),) = store.list_profiles()
    assert profile.input_shape["input_ids"] == (LONGEST,)
    assert any(f"row_length = {LONGEST}" in note for note in profile.notes)
    assert trainer.optimizer is None  # train() builds its own
    assert "do not fill whole optimizer steps" not in caplog.text

    seen: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    torch.manual_seed(123)
    trainer.train()
    assert trainer.state.global_step == 2
    assert seen == [plan.micro_batch_size] * (2 * plan.gradient_accumulation_steps)

    # Same run with the sizes given by hand: same weights, so the probe left nothing behind
    # (weights, optimizer, RNG streams).
    by_hand = make_trainer(
        tmp_path,
        per_device_train_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
    )
    torch.manual_seed(123)
    by_hand.train()
    for mine, theirs in zip(trainer.model.parameters(), by_hand.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_rows_that_leave_a_short_last_step_are_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(tmp_path, num_rows=64)
    plan = autotune_trainer(
        trainer, 48, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False
    )
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (16, 3)
    # 64 rows = 4 micro-batches of 16: the epoch's second step has one micro-batch.
    assert "an epoch is 4 micro-batches per rank (64 rows), 2 optimizer step(s): 1 of " in (
        caplog.text
    )
    assert "then a last one of 16 samples (1 micro-batch(es) per rank)" in caplog.text
    assert "the Trainer divides that step's losses by its own number of micro-batches" in (
        caplog.text
    )
    assert plan.epoch is not None and plan.epoch.num_optimizer_steps == 2
    seen: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    trainer.train()
    assert seen == [16, 16, 16, 16]


@pytest.mark.slow
def test_a_given_optimizer_is_probed_and_kept(tmp_path: Path) -> None:
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: more rows fit than AdamW
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=token_rows(),
        data_collator=pad_collate,
        optimizers=(optimizer, None),
    )
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES)
    with_sgd = autotune_trainer(trainer, 48, device=device, use_store=False)
    with_adamw = autotune_trainer(make_trainer(tmp_path), 48, device=device, use_store=False)
    assert trainer.optimizer is optimizer
    assert with_sgd.max_micro_batch_size > with_adamw.max_micro_batch_size


def test_auto_find_batch_size_is_refused(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, auto_find_batch_size=True)
    with pytest.raises(ConfigError, match="auto_find_batch_size=False"):
        autotune_trainer(trainer, 48, device="sim:64MiB", use_store=False)


def test_an_effective_batch_that_cannot_be_exact_is_refused(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(NoFeasiblePlanError, match="47.*autotune_trainer keeps the effective"):
        autotune_trainer(
            trainer,
            47,
            device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
            use_store=False,
            max_gradient_accumulation_steps=2,
        )
    assert trainer.args.per_device_train_batch_size == 2  # unchanged


def test_row_length_is_the_longest_sequence_field() -> None:
    assert row_length({"input_ids": [0] * 9, "labels": [0] * 9, "label": 1}) == 9
    assert row_length((torch.zeros(6, 2), 4)) == 6
    assert row_length({"pixel_values": torch.zeros(()), "x": 1}) == 0


@pytest.mark.slow
def test_the_trainers_precision_and_activation_checkpointing_are_probed(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profiles.sqlite3")
    device = SimulatedDevice(capacity_bytes=CAPACITY_BYTES)
    autotune_trainer(make_trainer(tmp_path), 48, device=device, store=store)
    bf16 = autotune_trainer(make_trainer(tmp_path, bf16=True), 48, device=device, store=store)
    profiles = {p.amp_dtype: p for _, p in store.list_profiles()}
    assert set(profiles) == {"", "bfloat16"}  # two cache keys: the second ran under autocast
    trainer = make_trainer(tmp_path, bf16=True, activation_checkpointing=True)
    checkpointed = autotune_trainer(trainer, 48, device=device, store=store)
    # Checkpointing keeps a layer's inputs instead of all its activations: more rows fit.
    assert checkpointed.max_micro_batch_size > bf16.max_micro_batch_size
    assert not trainer.model.is_activation_checkpointing  # off again until train() turns it on


def test_a_given_sample_is_probed_instead_of_the_dataset(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profiles.sqlite3")
    short = pad_collate([{"input_ids": list(range(16))}] * 2)
    plan = autotune_trainer(
        make_trainer(tmp_path),
        48,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        store=store,
        sample=short,
    )
    ((_, profile),) = store.list_profiles()
    assert profile.input_shape["input_ids"] == (16,)
    assert plan.max_micro_batch_size >= 48  # 16 tokens a row: three times the rows of 48 fit


def test_eval_sets_the_eval_batch_size_and_evaluate_runs_at_it(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    plan = autotune_trainer(
        trainer,
        48,
        device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES),
        eval=True,
        use_store=False,
    )
    assert plan.eval_micro_batch_size is not None
    assert plan.eval_micro_batch_size > plan.micro_batch_size  # no gradients, no activations kept
    assert trainer.args.per_device_eval_batch_size == plan.eval_micro_batch_size
    assert trainer.args.per_device_train_batch_size == plan.micro_batch_size
    seen: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    trainer.evaluate(eval_dataset=token_rows(plan.eval_micro_batch_size + 1))
    assert seen == [plan.eval_micro_batch_size, 1]


@pytest.mark.slow
def test_torchrun_ranks_agree_on_the_smaller_card_and_train_at_the_plan(tmp_path: Path) -> None:
    smaller = autotune_trainer(
        make_trainer(tmp_path), 96, device=SimulatedDevice(capacity_bytes=20 * MIB),
        use_store=False,
    )  # fmt: skip
    with socket.socket() as probe_port:  # a free port for the ranks' rendezvous
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        str(Path(__file__).with_name("hf_ddp_worker.py")), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # A session of its own, so a hang kills the ranks too, not only torchrun.
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as done:  # fmt: skip
        try:
            _, stderr = done.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(done.pid, signal.SIGKILL)
            pytest.fail("torchrun with 2 ranks did not finish within 300 s (a hang)")
    assert done.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    plan = ranks[0]["plan"]
    assert plan["world_size"] == 2
    assert plan["max_micro_batch_size"] == smaller.max_micro_batch_size
    for rank in ranks:
        assert rank["distributed"] and rank["total"] == 96 and rank["global_step"] == 2
        assert rank["per_device"] * rank["accumulation"] * 2 == 96
        assert rank["seen"] == [plan["micro_batch_size"]] * (
            2 * plan["gradient_accumulation_steps"]
        )
    assert ranks[0]["first_weight"] == ranks[1]["first_weight"]  # DDP kept them in step


def test_conditions_changed_after_tuning_are_warned_about_when_train_begins(
    tmp_path: Path,
) -> None:
    trainer = make_trainer(tmp_path, max_steps=1)
    autotune_trainer(
        trainer, 48, device=SimulatedDevice(capacity_bytes=CAPACITY_BYTES), use_store=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if issubclass(w.category, ConditionsWarning)]

    trainer.args.activation_checkpointing = True  # set after the plan was made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if issubclass(w.category, ConditionsWarning)]
    assert any(
        "autotune_trainer: micro-batch" in text
        and "activation checkpointing: measured with none detected, this process has Hugging "
        "Face gradient_checkpointing on 3 modules"
        in text
        for text in said
    ), said
