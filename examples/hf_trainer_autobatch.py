"""A Hugging Face Trainer script switched to autobatch with one call before ``trainer.train()``.

It trains a small GPT-2 (random weights) on synthetic rows of 16 to 64 tokens. ``autotune_trainer``
probes the Trainer's model with its loss, the AdamW it will create and its precision, on its
collator's batch of the longest rows, then sets ``per_device_train_batch_size`` and
``gradient_accumulation_steps`` so that micro-batch x accumulation x world size is exactly the
effective batch. Runs anywhere on a simulated card; on a GPU pass ``--device cuda:0`` (under
torchrun every rank probes its own GPU and the ranks agree)::

    python examples/hf_trainer_autobatch.py --device sim:24MiB --effective-batch-size 64 --steps 2
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

from autobatch.device import parse_device
from autobatch.integrations.hf import autotune_trainer

IGNORE_INDEX = -100  # labels Hugging Face's loss skips


def token_rows(count: int, max_len: int) -> list[dict[str, list[int]]]:
    """Rows of random tokens, 16 to ``max_len`` long (the longest once at least)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, max_len + 1, (count,), generator=generator).tolist()
    lengths[count // 2] = max_len
    return [
        {"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist()} for n in lengths
    ]


def pad_collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pads to the longest row of the batch; padding is masked out of the loss."""
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        attention_mask[i, : len(row["input_ids"])] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="sim:24MiB", help="sim:SIZE (CPU Trainer) or cuda:N")
    parser.add_argument("--effective-batch-size", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=64, help="longest row, tokens")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps to train")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")  # transformers' notes on CPU training and configs
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=args.max_len,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # transformers picks the loss from the class name, which here names none: say it, rather than
    # have it warn "`loss_type=None` ... unrecognized" and fall back to the same loss.
    model.loss_type = "ForCausalLM"
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = transformers.Trainer(
            model=model,
            args=transformers.TrainingArguments(
                output_dir=output_dir,
                use_cpu=parse_device(args.device).type == "sim",
                max_steps=args.steps,
                report_to=[],
                save_strategy="no",
                disable_tqdm=True,
            ),
            train_dataset=token_rows(4 * args.effective_batch_size, args.max_len),
            data_collator=pad_collate,
        )
        # The one call: was `auto_find_batch_size=True`, which halves the micro-batch only.
        plan = autotune_trainer(
            trainer, args.effective_batch_size, device=args.device, use_store=False
        )
        print(
            f"plan: per_device_train_batch_size {trainer.args.per_device_train_batch_size} x "
            f"gradient_accumulation_steps {trainer.args.gradient_accumulation_steps} x world "
            f"size {plan.world_size} = {trainer.get_total_train_batch_size(trainer.args)} "
            f"(largest that fits: {plan.max_micro_batch_size}, {plan.source})"
        )
        result = trainer.train()
        print(f"trained {result.global_step} optimizer steps; loss {result.training_loss:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
