"""Activation checkpointing chosen with the micro-batch, against the two fixed choices, measured
side by side in one run.

For GPT-2-, Llama- and BERT-shaped transformers (random weights; tiny on the CPU, larger with
``--size small``) on a capacity where the effective batch does not fit in one micro-batch
without checkpointing, ``autotune(..., activation_checkpointing="auto")`` plans; then real
training steps (forward, backward, AdamW step) are timed, with the mode applied, at:

- the chosen plan's micro-batch under its mode;
- no checkpointing at its largest micro-batch (the probe's maximum under ``"none"``);
- full checkpointing at its largest micro-batch (the probe's maximum under ``"full"``).

Each is the fastest of ``--repeats`` steps after one warm-up (the least disturbed on a shared
host), as seconds per sample; the noise is the median's excess over the fastest, as a
fraction. The last column is the chosen plan's time per sample over the best of the fixed two:
at most 1 + noise when the choice is right.

Capacities are simulated (:class:`autobatch.SimulatedDevice` counts live tensor bytes); the
steps themselves run on the CPU (or, from ``bench/gpu_check.py``, on ``cuda:0`` with the
capacity cut by ``gpu_fraction``).

Usage (from the repository root)::

    PYTHONPATH=. python bench/activation_checkpointing.py [--repeats 5] [--size tiny|small]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from autobatch.errors import AutobatchError
from autobatch.probing import activation_checkpointing_applied
from autobatch.tuning import TuneRequest, tune_request


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: its name, a builder of (model, one sample), the capacity where the batch
    binds, and the effective batch."""

    name: str
    build: Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]
    capacity: str
    effective_batch_size: int


def _tokens(vocab: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _gpt2(layers: int, hidden: int, seq: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=4, vocab_size=128, n_positions=seq,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config), _tokens(128, seq)


def _llama(layers: int, hidden: int, seq: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), _tokens(128, seq)


def _bert(layers: int, hidden: int, seq: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
        num_attention_heads=4, vocab_size=128, max_position_embeddings=seq,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config), _tokens(128, seq)


def cases(size: str) -> list[Case]:
    """The three shapes at ``size`` (``"tiny"``: seconds on a CPU; ``"small"``: minutes)."""
    layers, hidden, seq = (4, 64, 128) if size == "tiny" else (8, 256, 512)
    capacity = {"tiny": ("12MiB", "16MiB", "12MiB"), "small": ("160MiB", "200MiB", "160MiB")}
    gpt2, llama, bert = capacity[size]
    return [
        Case("gpt2-shaped", lambda: _gpt2(layers, hidden, seq), gpt2, 64),
        Case("llama-shaped", lambda: _llama(layers, hidden, seq), llama, 64),
        Case("bert-shaped", lambda: _bert(layers, hidden, seq), bert, 64),
    ]


def time_per_sample(
    model: torch.nn.Module,
    sample: dict[str, torch.Tensor],
    *,
    mode: Any,
    micro_batch_size: int,
    repeats: int,
) -> tuple[float, float]:
    """(seconds per sample, noise) of real steps at ``micro_batch_size`` under ``mode``: the
    fastest of ``repeats`` steps, and the median's excess over it as a fraction.

    A step is forward, loss, backward and an AdamW step; one warm-up first. The model's weights
    are restored afterwards (the steps train it)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {k: v.repeat(micro_batch_size, 1) for k, v in sample.items()}
    synchronize = torch.cuda.synchronize if batch["input_ids"].is_cuda else (lambda: None)
    seconds = []
    with activation_checkpointing_applied(model, mode):
        for step in range(repeats + 1):
            synchronize()
            started = time.perf_counter()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize()
            if step:
                seconds.append(time.perf_counter() - started)
    model.load_state_dict(state)
    # The fastest step: the one least disturbed by other work on a shared host.
    fastest = min(seconds)
    return fastest / micro_batch_size, (statistics.median(seconds) - fastest) / fastest


def compare(
    case: Case,
    *,
    device: str,
    repeats: int,
    place: str = "cpu",
    gpu_fraction: float | None = None,
) -> dict[str, Any]:
    """The chosen plan beside none and full at their largest micro-batches, for one case:
    probed on ``device`` (``"sim:SIZE"``, or ``"cuda:0"`` with ``gpu_fraction``), the steps
    timed on ``place``."""
    torch.manual_seed(0)
    model, sample = case.build()
    model, sample = model.to(place), {k: v.to(place) for k, v in sample.items()}
    tuned = tune_request(
        TuneRequest.build(
            model,
            sample,
            effective_batch_size=case.effective_batch_size,
            device=device,
            use_store=False,
            gpu_fraction=gpu_fraction,
            activation_checkpointing="auto",
        )
    )
    plan, outcome = tuned.plan, tuned.checkpointing
    assert outcome is not None
    largest = {r.mode: r.profile.max_micro_batch_size for r in outcome.runs if r.profile}
    row: dict[str, Any] = {
        "case": case.name,
        "capacity": case.capacity,
        "plan": f"{plan.activation_checkpointing} {plan.micro_batch_size}x"
        f"{plan.gradient_accumulation_steps}",
        "tried": list(outcome.tried),
        "why": outcome.why_tried,
    }
    points = {
        "chosen": (plan.activation_checkpointing, plan.micro_batch_size),
        "none": ("none", largest.get("none")),
        "full": ("full", largest.get("full")),
    }
    for label, (mode, size) in points.items():
        if size is None:
            row[label] = None
            continue
        try:
            row[label] = (size, *time_per_sample(model, sample, mode=mode, micro_batch_size=size,
                                                 repeats=repeats))  # fmt: skip
        except (AutobatchError, torch.OutOfMemoryError) as exc:
            row[label] = f"failed: {type(exc).__name__}"
    fixed = [row[k][1] for k in ("none", "full") if isinstance(row[k], tuple)]
    if isinstance(row["chosen"], tuple) and fixed:
        row["ratio"] = row["chosen"][1] / min(fixed)
        row["noise"] = max(
            row[k][2] for k in ("chosen", "none", "full") if isinstance(row[k], tuple)
        )
    return row


GPU_CAPACITY_BYTES = 2 * 2**30
"""The share of the card ``bench/gpu_check.py`` probes within (the small configs' effective
batch of 64 then needs several micro-batches without checkpointing)."""


def gpu_check_rows(
    *,
    dry_run: bool,
    total_bytes: int,
    allows: Callable[[str, float], bool],
    guarded: Callable[[str, Callable[[], Any]], Any],
) -> list[dict[str, Any]]:
    """``bench/gpu_check.py``'s rows: the three small configs on ``cuda:0`` within
    :data:`GPU_CAPACITY_BYTES` (``total_bytes``: the card's); on a dry run the tiny
    GPT-2-shaped one on its simulated capacity. ``allows(what, seconds)`` is the check's budget,
    ``guarded(what, run)`` runs one and records its failure."""
    rows: list[dict[str, Any]] = []
    for case in cases("tiny")[:1] if dry_run else cases("small"):
        if not allows(f"checkpointing {case.name}", 15.0 if dry_run else 60.0):
            break
        if dry_run:
            run = functools.partial(compare, case, device=f"sim:{case.capacity}", repeats=2)
        else:
            run = functools.partial(
                compare,
                case,
                device="cuda:0",
                repeats=5,
                place="cuda",
                gpu_fraction=GPU_CAPACITY_BYTES / total_bytes,
            )
        row = guarded(f"checkpointing {case.name}", run)
        if row is not None:
            rows.append(row)
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "does not fit"
    if isinstance(value, str):
        return value
    size, seconds, _ = value
    return f"m={size}: {seconds * 1e3:.3f} ms/sample"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The comparison table, one line per case."""
    lines = [
        "case          capacity  chosen plan     | chosen                  | none at its largest"
        "     | full at its largest     | chosen/best (noise)"
    ]
    for row in rows:
        ratio = f"{row['ratio']:.2f} (+-{row['noise']:.0%})" if "ratio" in row else "n/a"
        lines.append(
            f"{row['case']:<13} {row['capacity']:<9} {row['plan']:<15} | "
            f"{_cell(row['chosen']):<23} | {_cell(row['none']):<23} | "
            f"{_cell(row['full']):<23} | {ratio}"
        )
        lines.append(f"{'':<13} modes tried {', '.join(row['tried'])}: {row['why']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for case in cases(args.size):
        row = compare(case, device=f"sim:{case.capacity}", repeats=args.repeats)
        rows.append(row)
        print(f"{case.name}: done", file=sys.stderr, flush=True)
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
