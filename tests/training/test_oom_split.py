"""Window.run with on_oom="split": a micro-batch that runs out of memory is run again in pieces
cut from the original, and every optimizer step still sees the window's exact gradient."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError, DoesNotFitError
from autobatch.training._accumulator import Accumulator
from autobatch.training._limit_agreement import refuse_collective_forward
from autobatch.training._oom_split import DEFAULT_OOM_RETRY_WINDOWS, SplitEvent
from autobatch.training._window import StepStats
from tests.training.test_accumulator import RecordingSGD, full_batch_grad, make_data, mse

F64 = torch.float64
HEAVY = 1000.0  # a row whose first feature is this is "large": the gate runs out of memory on it
IGNORE_INDEX = -100

OomWhen = Callable[[str, torch.Tensor], bool]


def fake_oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test gate)")


class _GateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, rows: torch.Tensor, gate: Gate) -> torch.Tensor:
        ctx.gate, ctx.rows = gate, rows
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.gate.oom_when("backward", ctx.rows):
            raise fake_oom()
        return grad, None, None


class Gate(nn.Module):
    """Identity on the activations ``h`` that raises a CUDA-like OOM where ``oom_when(phase,
    rows)`` says; records the input rows it saw (their first feature identifies them here)."""

    def __init__(self, oom_when: OomWhen) -> None:
        super().__init__()
        self.oom_when = oom_when
        self.seen: list[list[float]] = []

    def forward(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.seen.append(rows[:, 0].tolist())
        if self.oom_when("forward", rows):
            raise fake_oom()
        return _GateFunction.apply(h, rows, self)  # type: ignore[no-any-return]


class GatedModel(nn.Module):
    """Linear -> tanh -> gate -> linear, float64. The gate sits after the first layer, so an
    OOM in backward comes after the last layer's gradient was already accumulated."""

    def __init__(self, oom_when: OomWhen) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 4).to(F64)
        self.gate = Gate(oom_when)
        self.last = nn.Linear(4, 1).to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.gate(torch.tanh(self.first(x)), x))


def heavy_above(rows: int, phase: str) -> OomWhen:
    """Out of memory in ``phase`` for a piece of more than ``rows`` rows holding a heavy row."""
    return lambda p, x: p == phase and x.shape[0] > rows and bool((x[:, 0] == HEAVY).any())


def with_ids(data: list[tuple[torch.Tensor, torch.Tensor]], heavy: set[tuple[int, int]] = set()):  # noqa: B006
    """Give row j of micro-batch i the first feature 100 * i + j (or HEAVY)."""
    for i, (x, _) in enumerate(data):
        for j in range(x.shape[0]):
            x[j, 0] = HEAVY if (i, j) in heavy else 100 * i + j
    return data


def reference_grads(
    data: list[tuple[torch.Tensor, torch.Tensor]], k: int
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Gradients of an unsplit run (manual loop, nothing runs out of memory)."""
    model = GatedModel(lambda phase, x: False)
    opt = RecordingSGD(model.parameters())
    acc = Accumulator(model, opt, gradient_accumulation_steps=k)
    for window in acc.windows(data):
        for micro in window:
            micro.backward(mse(model, micro.batch))
        window.step()
    return opt.grads, opt.params_before


def split_run(
    data: list[tuple[torch.Tensor, torch.Tensor]], k: int, oom_when: OomWhen, **kw: Any
) -> tuple[GatedModel, RecordingSGD, list[StepStats]]:
    model = GatedModel(oom_when)
    opt = RecordingSGD(model.parameters())
    acc = Accumulator(model, opt, gradient_accumulation_steps=k, on_oom="split", **kw)
    stats = [w.run(lambda batch: mse(model, batch)) for w in acc.windows(data)]
    return model, opt, stats


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for step_got, step_want in zip(got, want, strict=True):
        for g, w in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_forward_oom_runs_the_micro_batch_in_halves_with_the_same_gradient(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = with_ids(make_data([8, 8, 8, 8]), heavy={(1, 5)})
    want, _ = reference_grads(data, k=4)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        model, opt, stats = split_run(data, 4, heavy_above(4, "forward"))

    assert_same(opt.grads, want)
    (event,) = stats[0].splits
    assert event == SplitEvent(
        window_index=0,
        micro_step_index=1,
        old_micro_batch_size=8,
        new_micro_batch_size=4,
        phase="forward",
        reason="CUDA out of memory. Tried to allocate 2.00 GiB (test gate)",
    )
    # Micro-batch 1 failed whole, then ran as two halves of the original; 2 and 3 followed the
    # smaller size.
    assert [len(rows) for rows in model.gate.seen] == [8, 8, 4, 4, 4, 4, 4, 4]
    assert model.gate.seen[2] + model.gate.seen[3] == model.gate.seen[1]
    assert stats[0].micro_batch_size_limit == 4 and stats[0].num_micro_steps == 4
    (record,) = [r for r in caplog.records if r.name == "autobatch"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "window 0, micro-batch 1" in message and "size 8" in message
    assert "pieces of 4" in message and "CUDA out of memory" in message


def test_pieces_are_cut_from_the_original_micro_batch_never_from_a_piece() -> None:
    # Fits only at 2 rows: 8 fails, 4 fails, then pieces of 2 of the original (Composer's auto
    # micro-batching once went 16, 8, 2 by splitting a piece).
    data = with_ids(make_data([8]), heavy={(0, 6)})
    want, _ = reference_grads(data, k=1)
    model, opt, stats = split_run(data, 1, heavy_above(2, "forward"))

    assert_same(opt.grads, want)
    # The first half [0:4) ran; the second [4:8) failed and was re-cut from the original as
    # [4:6), [6:8) (a forward that fails adds no gradient, so the rows done stay done).
    assert [len(rows) for rows in model.gate.seen] == [8, 4, 4, 2, 2]
    original = model.gate.seen[0]
    assert model.gate.seen[1:] == [original[0:4], original[4:8], original[4:6], original[6:8]]
    assert [(e.old_micro_batch_size, e.new_micro_batch_size) for e in stats[0].splits] == [
        (8, 4),
        (4, 2),
    ]


def test_backward_oom_recomputes_the_window_and_keeps_the_gradient_exact() -> None:
    # Micro-batch 2 runs out of memory in backward after the last layer's gradient was added:
    # the window is run again from zero gradients, so nothing of the failed pass remains.
    data = with_ids(make_data([4, 4, 8, 4, 4, 4, 4, 4]), heavy={(2, 3)})
    want, _ = reference_grads(data, k=4)
    model, opt, stats = split_run(data, 4, heavy_above(4, "backward"))

    assert_same(opt.grads, want)
    (event,) = stats[0].splits
    assert (event.phase, event.recomputed, event.micro_step_index) == ("backward", True, 2)
    assert [len(rows) for rows in model.gate.seen[:7]] == [4, 4, 8, 4, 4, 4, 4]
    with torch.no_grad():  # the logged loss counts each sample once, recomputed or not
        want_loss = mse(reference_model_at(opt.params_before[0]), _cat(data[:4])).item()
    assert float(stats[0].loss) == pytest.approx(want_loss, rel=1e-12)


def reference_model_at(params: list[torch.Tensor]) -> GatedModel:
    model = GatedModel(lambda phase, x: False)
    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    return model


def _cat(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])


def test_the_planned_size_is_tried_again_after_clean_windows() -> None:
    data = with_ids(make_data([8] * 10), heavy={(0, 1)})
    want, _ = reference_grads(data, k=2)
    model, opt, stats = split_run(data, 2, heavy_above(4, "forward"), oom_retry_windows=2)

    assert_same(opt.grads, want)
    assert [s.micro_batch_size_limit for s in stats] == [4, 4, 4, None, None]
    assert [len(s.splits) for s in stats] == [1, 0, 0, 0, 0]
    # Windows 1 and 2 ran in pieces of 4; window 3 tried the planned 8 again, and it fitted.
    assert [len(rows) for rows in model.gate.seen[5:]] == [4] * 8 + [8] * 4
    assert Accumulator.__init__.__kwdefaults__["oom_retry_windows"] == DEFAULT_OOM_RETRY_WINDOWS


def test_a_row_that_does_not_fit_alone_raises_does_not_fit_naming_it() -> None:
    data = with_ids(make_data([4, 4]), heavy={(1, 3)})
    model = GatedModel(lambda phase, x: bool((x[:, 0] == HEAVY).any()))
    acc = Accumulator(model, RecordingSGD(model.parameters()), gradient_accumulation_steps=2,
                      on_oom="split")  # fmt: skip
    (window,) = acc.windows(data)
    with pytest.raises(DoesNotFitError, match=r"micro-batch 1 of window 0 .* size 1: its row 3"):
        window.run(lambda batch: mse(model, batch))


def test_a_window_that_does_not_fit_can_be_skipped_and_leaves_no_gradient() -> None:
    # Window 0's micro-batch 0 ran backward before micro-batch 1's row 3 failed alone. Skipping
    # the window (catch, continue) must apply none of it: not in a step, not in window 1's.
    data = with_ids(make_data([4, 4, 4, 4]), heavy={(1, 3)})
    model = GatedModel(lambda phase, x: bool((x[:, 0] == HEAVY).any()))
    optimizer = RecordingSGD(model.parameters())
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=2, on_oom="split")
    (expected,), _ = reference_grads(data[2:], 2)  # window 1 alone, from the same weights
    stepped = []
    for window in acc.windows(data):
        try:
            window.run(lambda batch: mse(model, batch))
        except DoesNotFitError:
            assert all(p.grad is None for p in model.parameters())
            assert not window.pending_backward
            continue
        stepped.append(window.index)

    assert stepped == [1]
    for got, want in zip(optimizer.grads[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_raise_propagates_the_oom_and_split_propagates_other_errors() -> None:
    data = with_ids(make_data([4, 4]), heavy={(0, 0)})
    model = GatedModel(heavy_above(1, "forward"))
    acc = Accumulator(model, RecordingSGD(model.parameters()), gradient_accumulation_steps=2)
    (window,) = acc.windows(data)
    with pytest.raises(torch.OutOfMemoryError):
        window.run(lambda batch: mse(model, batch))

    acc = Accumulator(model, RecordingSGD(model.parameters()), gradient_accumulation_steps=2,
                      on_oom="split")  # fmt: skip
    (window,) = acc.windows(data)

    def shape_error(batch: Any) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        window.run(shape_error)


def test_run_without_oom_is_the_manual_loop() -> None:
    data = make_data([3, 5, 2, 6])
    want, _ = reference_grads(data, k=2)
    _, opt, stats = split_run(data, 2, lambda phase, x: False)
    assert_same(opt.grads, want)
    assert [(s.splits, s.micro_batch_size_limit, s.num_micro_steps) for s in stats] == [
        ((), None, 2),
        ((), None, 2),
    ]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"on_oom": "halve"}, "on_oom must be 'raise' or 'split', got 'halve'"),
        ({"oom_retry_windows": 0}, "oom_retry_windows must be an int >= 1, got 0"),
        ({"oom_retry_windows": True}, "oom_retry_windows must be an int >= 1, got True"),
    ],
)
def test_bad_split_options(kw: dict[str, Any], match: str) -> None:
    model = nn.Linear(1, 1)
    with pytest.raises(ConfigError, match=match):
        Accumulator(model, torch.optim.SGD(model.parameters()), gradient_accumulation_steps=1, **kw)


def test_run_after_a_manual_backward_is_refused() -> None:
    data = make_data([2, 2])
    model = GatedModel(lambda phase, x: False)
    acc = Accumulator(model, RecordingSGD(model.parameters()), gradient_accumulation_steps=2)
    (window,) = acc.windows(data)
    first = next(iter(window))
    first.backward(mse(model, first.batch))
    with pytest.raises(ConfigError, match="window 0 already ran backward or stepped"):
        window.run(lambda batch: mse(model, batch))


def test_count_fn_must_be_additive_over_rows() -> None:
    data = with_ids(make_data([4]), heavy={(0, 0)})
    model = GatedModel(heavy_above(2, "forward"))
    acc = Accumulator(model, RecordingSGD(model.parameters()), gradient_accumulation_steps=1,
                      on_oom="split")  # fmt: skip
    (window,) = acc.windows(data, count_fn=lambda batch: 4)  # not a count of rows or tokens
    with pytest.raises(ConfigError, match="count_fn is not additive over rows: .* counts 4, its "
                       "pieces 8"):  # fmt: skip
        window.run(lambda batch: mse(model, batch))


class Rows:
    """A batch object torch's pytree does not know: nothing in it can be cut into pieces."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


@pytest.mark.parametrize(
    ("batch", "name"),
    [
        (Rows(torch.ones(4, 3, dtype=F64)), "Rows"),
        ([{"x": torch.ones(3, dtype=F64)} for _ in range(4)], "list"),  # collate_fn=list
    ],
)
def test_a_batch_that_cannot_be_cut_is_refused_before_any_step(batch: Any, name: str) -> None:
    # count_fn is given, so the error must not ask for it: it must say why the batch cannot be
    # split and what to do, at once, not when the first OOM comes hours into training.
    model = nn.Linear(3, 1).to(F64)
    acc = Accumulator(model, RecordingSGD(model.parameters()), gradient_accumulation_steps=1,
                      on_oom="split")  # fmt: skip
    (window,) = acc.windows([batch], count_fn=lambda batch: 4)
    calls: list[int] = []
    with pytest.raises(
        ConfigError,
        match=rf"on_oom='split' cannot cut micro-batch 0 of window 0 \(a {name}\) into pieces: "
        r".*tensor, or a tuple/list/dict of tensors.*or use on_oom='raise'",
    ):
        window.run(lambda batch: torch.tensor(calls.append(1) or 0.0, requires_grad=True))
    assert calls == []
    assert all(p.grad is None for p in model.parameters())


def test_pieces_of_a_hugging_face_batch_are_batch_encodings() -> None:
    # Hugging Face code reads batch.input_ids: a piece must keep the batch's type, not become a
    # dict that fails with AttributeError only when the first split comes.
    from transformers import BatchEncoding

    model = nn.Linear(3, 1).to(F64)
    optimizer = RecordingSGD(model.parameters())
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=1, on_oom="split")
    x, y = torch.randn(4, 3, dtype=F64), torch.randn(4, 1, dtype=F64)
    batch = BatchEncoding({"input_ids": x, "labels": y})
    seen: list[tuple[str, int]] = []

    def loss_of(piece: BatchEncoding) -> torch.Tensor:
        seen.append((type(piece).__name__, piece.input_ids.shape[0]))
        if piece.input_ids.shape[0] > 2:
            raise fake_oom()
        return ((model(piece.input_ids) - piece.labels) ** 2).mean()

    (window,) = acc.windows([batch])
    window.run(loss_of)

    assert seen == [("BatchEncoding", 4), ("BatchEncoding", 2), ("BatchEncoding", 2)]
    reference = nn.Linear(3, 1).to(F64)
    params = dict(zip(("weight", "bias"), optimizer.params_before[0], strict=True))
    reference.load_state_dict(params)
    ((reference(x) - y) ** 2).mean().backward()
    for got, want in zip(optimizer.grads[0], reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=0, atol=1e-12)


# -- the "done when": a real byte count on the simulated device -----------------------


class TokenMLP(nn.Module):
    """Per-token model (no attention), float64: padding changes no valid token's loss."""

    def __init__(self, vocab_size: int = 64, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab_size, 32).to(F64)
        self.hidden = nn.Linear(32, width).to(F64)
        self.out = nn.Linear(width, vocab_size).to(F64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(input_ids))))


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )


def num_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def padded(lengths: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    longest = max(lengths)
    ids = torch.randint(0, 64, (len(lengths), longest), generator=generator)
    mask = torch.arange(longest) < torch.tensor(lengths)[:, None]
    return {"input_ids": ids, "labels": ids.masked_fill(~mask, IGNORE_INDEX)}


def step_peak_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Peak live bytes of one forward/backward with gradients present, weights resident."""
    token_loss(model, batch).backward()
    device = SimulatedDevice(capacity_bytes=2**40)
    with device.measure(list(model.parameters()) + [p.grad for p in model.parameters()]) as peak:  # type: ignore[operator]
        token_loss(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return peak.allocated_bytes


def test_done_when_three_windows_with_one_long_sample_split_on_the_simulated_device(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [[int(n) for n in torch.randint(4, 17, (8,), generator=g)] for _ in range(12)]
    lengths[2][5] = 64  # window 0, micro-batch 2: one sequence four times the longest
    data = [padded(sizes, g) for sizes in lengths]

    probe = TokenMLP()
    fits = step_peak_bytes(probe, {k: v[:4] for k, v in data[2].items()})
    does_not = step_peak_bytes(probe, data[2])
    usual = max(step_peak_bytes(probe, b) for b in data[:2])
    assert usual < fits < does_not
    capacity = (fits + does_not) // 2

    def train(device: SimulatedDevice | None) -> tuple[RecordingSGD, list[StepStats]]:
        model = TokenMLP()
        opt = RecordingSGD(model.parameters())
        acc = Accumulator(model, opt, gradient_accumulation_steps=4,
                          on_oom="split" if device else "raise")  # fmt: skip
        stats = []
        resident = list(model.parameters())
        with device.measure(resident) if device else _nothing():
            for window in acc.windows(data, count_fn=num_tokens):
                stats.append(window.run(lambda batch: token_loss(model, batch)))
        return opt, stats

    want_opt, _ = train(None)
    device = SimulatedDevice(capacity_bytes=capacity)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        got_opt, stats = train(device)

    assert device.num_ooms == 1
    assert_same(got_opt.grads, want_opt.grads)
    # The full window's gradient, in one pass over its tokens (padding counts for nothing).
    for step, grads in enumerate(got_opt.grads):
        model = TokenMLP()
        with torch.no_grad():
            for p, v in zip(model.parameters(), got_opt.params_before[step], strict=True):
                p.copy_(v)
        window = data[4 * step : 4 * step + 4]
        total = sum(num_tokens(b) for b in window)
        loss = sum(token_loss(model, b) * num_tokens(b) for b in window) / total
        full = torch.autograd.grad(loss, list(model.parameters()))
        for g_got, g_full in zip(grads, full, strict=True):
            torch.testing.assert_close(g_got, g_full, rtol=1e-12, atol=1e-12)
    (event,) = stats[0].splits
    assert (event.window_index, event.micro_step_index) == (0, 2)
    assert (event.old_micro_batch_size, event.new_micro_batch_size) == (8, 4)
    assert "out of memory" in event.reason
    assert [s.micro_batch_size_limit for s in stats] == [4, 4, 4]
    assert [len(s.splits) for s in stats] == [1, 0, 0]
    assert any("window 0, micro-batch 2" in r.getMessage() for r in caplog.records)


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_full_batch_grad_helper_agrees_with_the_split_run() -> None:
    # One window of one micro-batch split in four: the gradient of the whole batch's mean.
    data = with_ids(make_data([8]), heavy={(0, 0)})
    model, opt, _ = split_run(data, 1, heavy_above(2, "forward"))
    want = full_batch_grad(reference_model_at(opt.params_before[0]), opt.params_before[0], data)
    for g, w in zip(opt.grads[0], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# -- BatchNorm: a piece of 1 sample has 1 value per channel, which torch refuses in training -----

# The tests' micro-batches are small on purpose; the Accumulator warns of that once per loop.
quiet_norm = pytest.mark.filterwarnings("ignore::autobatch.errors.SmallMicroBatchNormWarning")


class NormModel(nn.Module):
    """Linear -> BatchNorm1d -> tanh -> gate -> linear, float64 (``(N, C)`` into the norm)."""

    def __init__(self, oom_when: OomWhen, **norm_kw: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 4).to(F64)
        self.norm = nn.BatchNorm1d(4, **norm_kw).to(F64)
        self.gate = Gate(oom_when)
        self.last = nn.Linear(4, 1).to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.gate(torch.tanh(self.norm(self.first(x))), x))


@quiet_norm
def test_batch_norm_pieces_never_have_one_row_and_weigh_by_count() -> None:
    # Micro-batch 0 (6 rows) fits only in pieces of 3; micro-batch 1 (7 rows) then runs at that
    # limit. Cut 3, 3, 1 its last piece would hand BatchNorm 1 value per channel (torch's
    # "Expected more than 1 value per channel when training"); it runs as 3, 2, 2.
    data = with_ids(make_data([6, 7]))
    model = NormModel(lambda phase, x: phase == "forward" and x.shape[0] > 3)
    optimizer = RecordingSGD(model.parameters())
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=2, on_oom="split")
    (window,) = acc.windows(data)
    stats = window.run(lambda batch: mse(model, batch))

    assert [len(rows) for rows in model.gate.seen] == [6, 3, 3, 3, 2, 2]
    assert [(e.old_micro_batch_size, e.new_micro_batch_size) for e in stats.splits] == [(6, 3)]
    # BatchNorm normalises each piece by its own statistics, so the gradient is that of the
    # pieces run, each weighted by its count of the window's 13 rows.
    reference = NormModel(lambda phase, x: False)
    reference.load_state_dict(model.state_dict())  # buffers too (unused in training mode)
    with torch.no_grad():
        for p, v in zip(reference.parameters(), optimizer.params_before[0], strict=True):
            p.copy_(v)
    pieces = [(0, 0, 3), (0, 3, 6), (1, 0, 3), (1, 3, 5), (1, 5, 7)]
    loss = (
        sum(mse(reference, (data[i][0][a:b], data[i][1][a:b])) * (b - a) for i, a, b in pieces) / 13
    )
    want = torch.autograd.grad(loss, list(reference.parameters()))
    for got, w in zip(optimizer.grads[0], want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)


@quiet_norm
@pytest.mark.parametrize(
    ("rows", "phase", "norm_kw", "train", "size", "where"),
    [
        # 4 rows: 4 fails, then rows 2..3 fail at 2; 1 row is too few for BatchNorm.
        (4, "forward", {}, True, 2, "rows 2..3 ran out of memory in forward"),
        # The same with a norm that has no running statistics: batch statistics in eval mode.
        (4, "forward", {"track_running_stats": False}, False, 2, "rows 2..3 ran out of memory"),
        # 3 rows fail in backward: halves of 2 leave a row alone, so no smaller cut exists.
        (3, "backward", {}, True, 3, "rows 0..2 ran out of memory in backward"),
    ],
)
def test_batch_norm_that_cannot_be_cut_smaller_raises_does_not_fit_naming_it(
    rows: int, phase: str, norm_kw: dict[str, Any], train: bool, size: int, where: str
) -> None:
    data = with_ids(make_data([rows]), heavy={(0, rows - 1)})
    model = NormModel(heavy_above(1, phase), **norm_kw).train(train)
    optimizer = RecordingSGD(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=1, on_oom="split")
    (window,) = acc.windows(data)
    with pytest.raises(DoesNotFitError) as caught:
        window.run(lambda batch: mse(model, batch))

    message = str(caught.value)
    assert f"micro-batch 0 of window 0 does not fit at micro-batch size {size}: its {where}" in (
        message
    )
    assert "BatchNorm1d layer 'norm'" in message and "at least 2 samples per piece" in message
    assert [r.purpose for r in caught.value.remedies] == [
        "the worst-case batch when probing (autobatch.worst_case_sample)",
        "GroupNorm or LayerNorm instead of BatchNorm",
        "BatchNorm in eval mode (normalising with running statistics)",
    ]
    assert "GroupNorm or LayerNorm instead of BatchNorm" in message  # str() words the remedies
    assert min(len(seen) for seen in model.gate.seen) >= 2  # no piece of 1 row was ever run
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.grads == []  # not stepped
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_batch_norm_with_running_statistics_in_eval_mode_splits_down_to_one_row() -> None:
    # Eval mode normalises each row by the running statistics: 1 row is fine, and exact.
    data = with_ids(make_data([4]), heavy={(0, 3)})
    model = NormModel(heavy_above(1, "forward")).eval()
    optimizer = RecordingSGD(model.parameters())
    acc = Accumulator(model, optimizer, gradient_accumulation_steps=1, on_oom="split")
    (window,) = acc.windows(data)
    window.run(lambda batch: mse(model, batch))

    assert [len(rows) for rows in model.gate.seen] == [4, 2, 2, 1, 1]
    reference = NormModel(lambda phase, x: False).eval()
    with torch.no_grad():
        for p, v in zip(reference.parameters(), optimizer.params_before[0], strict=True):
            p.copy_(v)
    want = torch.autograd.grad(mse(reference, data[0]), list(reference.parameters()))
    for got, w in zip(optimizer.grads[0], want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)


def test_sync_batch_norm_in_training_mode_is_refused_for_splitting_under_ddp() -> None:
    # It gathers statistics from every rank at every forward, and pieces run on one rank only.
    # DDP refuses SyncBatchNorm on CPU, so the check is run on the module DDP would wrap.
    model = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4), nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"SyncBatchNorm layer '1' gathers statistics from "
                       r"every rank .*use BatchNorm instead, or use on_oom='raise'"):  # fmt: skip
        refuse_collective_forward(model)
    refuse_collective_forward(model.eval())  # in eval mode it uses its running statistics
