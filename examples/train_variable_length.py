"""Train a GPT-2-tiny (random weights) on variable-length batches where 1% of the sequences are
four times longer than the rest, on a simulated card, without a crash.

The plan is probed at the usual length, so a micro-batch holding one long sequence (padded to
it) does not fit. ``Accumulator(..., on_oom="split")`` runs that micro-batch again in halves cut
from the original, weighted by their token counts, so every optimizer step still applies the
window's exact mean gradient. Each split is logged, and the profile store learns the smaller
size, so the next run plans with it from the start::

    python examples/train_variable_length.py --device sim:20MiB --micro-steps 200

Measured with ``/usr/bin/time`` on a shared 2-core x86 VM (torch 2.13 CPU build): the first
run, with an empty store, took 28 s of wall time and 36 s of CPU time; the next, whose store
already knew the smaller size, 16 s and 17 s.

Probing with ``autobatch.worst_case_sample(dataset, key=len, ...)`` instead (the longest
sequence) gives a plan with no splits at all, at a smaller micro-batch.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from collections.abc import Iterator

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autobatch
from autobatch import Accumulator, split_recorder

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100  # labels Hugging Face's loss skips


EXAMPLE_STORE = os.path.join(tempfile.gettempdir(), "autobatch-examples.sqlite3")
"""Where the example keeps its profiles: its own store, never the user's default one."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="sim:20MiB", help="cuda:N, cpu or sim:SIZE")
    parser.add_argument("--effective-batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32, help="usual longest sequence, tokens")
    parser.add_argument("--long-fraction", type=float, default=0.01, help="share of long ones")
    parser.add_argument("--micro-steps", type=int, default=200, help="micro-batches to train on")
    parser.add_argument(
        "--store",
        default=EXAMPLE_STORE,
        help="profile store path (default: the examples' own, apart from your store)",
    )
    return parser.parse_args(argv)


def padded(lengths: list[int], vocab_size: int, generator: torch.Generator) -> Batch:
    """A micro-batch of random tokens of these lengths, padded to the longest."""
    longest = max(lengths)
    input_ids = torch.randint(0, vocab_size, (len(lengths), longest), generator=generator)
    attention_mask = torch.arange(longest) < torch.tensor(lengths)[:, None]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask.long(),
        "labels": input_ids.masked_fill(~attention_mask, IGNORE_INDEX),
    }


def predicted_tokens(batch: Batch) -> int:
    """Tokens the causal-LM loss averages over: labels after the shift by one, minus padding."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    long_len = 4 * args.seq_len
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=long_len,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # transformers picks the loss from the class name, which here names none: say it, rather than
    # have it warn "`loss_type=None` ... unrecognized" and fall back to the same loss.
    model.loss_type = "ForCausalLM"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    device = autobatch.resolve_device(args.device)
    generator = torch.Generator().manual_seed(0)

    # Probed at the usual length: the plan does not know about the long sequences.
    usual = padded([args.seq_len], config.vocab_size, generator)
    plan = autobatch.autotune(
        model, usual, effective_batch_size=args.effective_batch_size, optimizer=optimizer,
        device=device, store=args.store,
    )  # fmt: skip
    print(
        f"plan: micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps} "
        f"accumulation steps, probed at {args.seq_len} tokens ({plan.source})",
        flush=True,
    )

    def micro_batches() -> Iterator[Batch]:
        for _ in range(args.micro_steps):
            lengths = []
            for _ in range(plan.micro_batch_size):
                if float(torch.rand((), generator=generator)) < args.long_fraction:
                    lengths.append(long_len)
                else:
                    lengths.append(int(torch.randint(args.seq_len // 2, args.seq_len + 1, (),
                                                     generator=generator)))  # fmt: skip
            yield padded(lengths, config.vocab_size, generator)

    model.train()
    accumulator = Accumulator(
        model,
        optimizer,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        max_grad_norm=1.0,
        on_oom="split",
        # The store learns the size that fitted: the next run's autotune starts from it.
        on_split=split_recorder(model, usual, optimizer=optimizer, device=device, store=args.store),
    )
    num_micro_steps = num_splits = num_long = 0
    smallest = plan.micro_batch_size
    # On a simulated card, its byte count runs over the whole loop (on CUDA this is a no-op
    # bracket around the real allocator).
    with device.measure(list(model.parameters())):
        for window in accumulator.windows(micro_batches(), count_fn=predicted_tokens):
            num_long += sum(int(m.batch["input_ids"].shape[1] == long_len) for m in window)
            stats = window.run(lambda batch: model(**batch).loss)  # a mean over batch's tokens
            num_micro_steps += stats.num_micro_steps
            num_splits += len(stats.splits)
            smallest = min([smallest, *(s.new_micro_batch_size for s in stats.splits)])
            if window.index % 10 == 0 or stats.splits:
                print(
                    f"step {window.index}: loss {float(stats.loss):.4f} over "
                    f"{stats.global_count} tokens, splits {len(stats.splits)}, piece limit "
                    f"{stats.micro_batch_size_limit}",
                    flush=True,
                )
    print(
        f"done: {num_micro_steps} micro-steps, {num_long} with a {long_len}-token sequence, "
        f"{num_splits} splits (smallest piece {smallest}), 0 crashes",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
