"""Autotune a GPT-2 (random weights) and train it for a few optimizer steps with the helper.

The sequences have random lengths and are padded, so the loss is a mean over *tokens*: each
micro-batch's loss is weighted by its share of the window's predicted tokens (``count_fn``), not
by 1 / gradient_accumulation_steps. Runs anywhere on a simulated card; on a GPU pass
``--device cuda:0``::

    python examples/train_gpt2.py --device sim:40MiB --effective-batch-size 32 --steps 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterator

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autobatch
from autobatch import Accumulator

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100  # labels Hugging Face's loss skips


EXAMPLE_STORE = os.path.join(tempfile.gettempdir(), "autobatch-examples.sqlite3")
"""Where the example keeps its profiles: its own store, never the user's default one."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="sim:40MiB", help="cuda:N, cpu or sim:SIZE")
    parser.add_argument("--effective-batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    parser.add_argument(
        "--store",
        default=EXAMPLE_STORE,
        help="profile store path (default: the examples' own, apart from your store)",
    )
    return parser.parse_args(argv)


def token_batches(seq_len: int, vocab_size: int, seed: int) -> Callable[[int], Batch]:
    """``n -> batch`` of n synthetic sequences of random length, padded to ``seq_len``."""
    generator = torch.Generator().manual_seed(seed)

    def make(n: int) -> Batch:
        input_ids = torch.randint(0, vocab_size, (n, seq_len), generator=generator)
        lengths = torch.randint(seq_len // 4, seq_len + 1, (n,), generator=generator)
        attention_mask = torch.arange(seq_len) < lengths[:, None]
        labels = input_ids.masked_fill(~attention_mask, IGNORE_INDEX)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask.long(),
            "labels": labels,
        }

    return make


def predicted_tokens(batch: Batch) -> int:
    """Tokens the causal-LM loss averages over: labels after the shift by one, minus padding."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=args.seq_len,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # transformers picks the loss from the class name, which here names none: say it, rather than
    # have it warn "`loss_type=None` ... unrecognized" and fall back to the same loss.
    model.loss_type = "ForCausalLM"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    make_batch = token_batches(args.seq_len, config.vocab_size, seed=0)

    plan = autobatch.autotune(
        model,
        make_batch,  # n -> batch: the probe builds micro-batches of any size from it
        effective_batch_size=args.effective_batch_size,
        optimizer=optimizer,  # AdamW's moments count; the probe restores the optimizer after
        device=args.device,
        store=args.store,
    )
    print(
        f"plan: micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps} "
        f"accumulation steps = {plan.effective_batch_size} sequences per optimizer step "
        f"(sizes {list(plan.micro_batch_sizes)}, {plan.source})",
        flush=True,
    )

    def micro_batches() -> Iterator[Batch]:  # a DataLoader with batch_size=plan's size in practice
        while True:
            for size in plan.micro_batch_sizes:
                yield make_batch(size)

    model.train()
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=args.steps)
    accumulator = Accumulator(
        model,
        optimizer,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        scheduler=scheduler,
        max_grad_norm=1.0,
    )
    for window in accumulator.windows(micro_batches(), count_fn=predicted_tokens):
        for micro in window:
            with micro.sync_context():
                micro.backward(model(**micro.batch).loss)  # a mean over this micro's tokens
        stats = window.step()
        print(
            f"step {window.index}: loss {float(stats.loss):.4f} over {stats.global_count} tokens "
            f"in {stats.num_micro_steps} micro-batches, grad norm {stats.grad_norm:.3f}",
            flush=True,
        )
        if window.index + 1 == args.steps:
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
