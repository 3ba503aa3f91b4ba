"""Accumulator: every optimizer step sees exactly the gradient of its window's full batch."""

from __future__ import annotations

import collections
import copy
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import autobatch.training._window as window_module
from autobatch.errors import ConfigError, SmallMicroBatchNormWarning
from autobatch.training._accumulator import Accumulator
from autobatch.training._window import StepStats

F64 = torch.float64


class RecordingSGD(torch.optim.SGD):
    """SGD that records the parameters it starts from and the gradients it applies."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.params_before: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        ps = [p for g in self.param_groups for p in g["params"]]
        self.params_before.append([p.detach().clone() for p in ps])
        self.grads.append([p.grad.detach().clone() for p in ps])  # type: ignore[union-attr]
        return super().step(closure)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(F64)


def make_data(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 3, generator=g, dtype=F64), torch.randn(n, 1, generator=g, dtype=F64))
        for n in sizes
    ]


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def full_batch_grad(
    model: nn.Module, params: list[torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """Gradient of the mean loss over all samples of ``batches``, at ``params``."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p, v in zip(ref.parameters(), params, strict=True):
            p.copy_(v)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return list(torch.autograd.grad(mse(ref, (x, y)), list(ref.parameters())))


def train(
    acc: Accumulator, data: list[tuple[torch.Tensor, torch.Tensor]], **kw: Any
) -> list[StepStats]:
    stats = []
    for window in acc.windows(data, **kw):
        for micro in window:
            with micro.sync_context():
                micro.backward(mse(acc.model, micro.batch))
        stats.append(window.step())
    return stats


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_unequal_micro_batches_give_the_full_batch_gradient() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([3, 5])
    stats = train(Accumulator(model, opt, gradient_accumulation_steps=2), data)

    assert len(opt.grads) == 1 and stats[0].global_count == 8
    want = full_batch_grad(model, opt.params_before[0], data)
    assert_grads_close(opt.grads[0], want)
    # The naive loss / gradient_accumulation_steps would weight the 3 samples like the 5.
    per_micro = [full_batch_grad(model, opt.params_before[0], [b]) for b in data]
    naive = [(a + b) / 2 for a, b in zip(*per_micro, strict=True)]
    assert max(float((n - w).abs().max()) for n, w in zip(naive, want, strict=True)) > 1e-3


def test_token_loss_is_divided_by_the_window_token_count() -> None:
    w = nn.Parameter(torch.tensor(1.0, dtype=F64))
    opt = RecordingSGD([w])
    pad = 100.0  # padding values that would dominate the loss if they were counted
    micro_a = {
        "values": torch.tensor([[1.0, 1.0, pad, pad]], dtype=F64),
        "mask": torch.tensor([[True, True, False, False]]),
    }
    micro_b = {
        "values": torch.tensor([[3.0] * 5 + [pad], [3.0] * 3 + [pad] * 3], dtype=F64),
        "mask": torch.tensor([[True] * 5 + [False], [True] * 3 + [False] * 3]),
    }

    def token_mean(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        per_token = w * batch["values"]
        return per_token[batch["mask"]].mean()

    acc = Accumulator(nn.Module(), opt, gradient_accumulation_steps=2)
    for window in acc.windows([micro_a, micro_b], count_fn=lambda b: b["mask"].sum()):
        assert [m.count for m in window] == [2, 8]
        losses = []
        for micro in window:
            loss = token_mean(micro.batch)
            losses.append(loss.item())
            micro.backward(loss)
        stats = window.step()

    assert losses == [1.0, 3.0]
    assert float(stats.loss) == pytest.approx(2.6, abs=1e-12)  # not (1 + 3) / 2 = 2.0
    assert stats.local_count == stats.global_count == 10
    # Full batch: both micro-batches padded to one tensor, mean over the 10 counted tokens.
    values = torch.full((3, 6), pad, dtype=F64)
    values[0, :4], values[1:] = micro_a["values"][0], micro_b["values"]
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, :4], mask[1:] = micro_a["mask"][0], micro_b["mask"]
    w_ref = torch.tensor(1.0, dtype=F64, requires_grad=True)
    full = (w_ref * values)[mask].mean()
    (want,) = torch.autograd.grad(full, [w_ref])
    assert full.item() == pytest.approx(2.6, abs=1e-12)
    assert float(opt.grads[0][0]) == pytest.approx(2.6, abs=1e-12)
    torch.testing.assert_close(opt.grads[0][0], want, rtol=0, atol=1e-10)


def test_sum_reduction_is_weighted_like_mean() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([2, 7, 4])
    acc = Accumulator(model, opt, gradient_accumulation_steps=3)
    for window in acc.windows(data):
        for micro in window:
            x, y = micro.batch
            micro.backward(((model(x) - y) ** 2).sum(), reduction="sum")
        window.step()
    assert_grads_close(opt.grads[0], full_batch_grad(model, opt.params_before[0], data))


def test_ten_micro_batches_with_k4_step_three_times() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([2, 3, 1, 4, 2, 2, 5, 1, 3, 2])
    stats = train(Accumulator(model, opt, gradient_accumulation_steps=4), data)

    assert [s.num_micro_steps for s in stats] == [4, 4, 2]
    assert [s.global_count for s in stats] == [10, 10, 5]
    assert len(opt.grads) == 3
    for i, window_data in enumerate([data[0:4], data[4:8], data[8:10]]):
        assert_grads_close(opt.grads[i], full_batch_grad(model, opt.params_before[i], window_data))
    assert all(p.grad is None for p in model.parameters())


def test_two_epochs_never_carry_gradients_across_windows() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([1 + i % 3 for i in range(63)])
    acc = Accumulator(model, opt, gradient_accumulation_steps=8)
    stats = train(acc, data) + train(acc, data)

    assert len(opt.grads) == 16
    assert [s.num_micro_steps for s in stats] == ([8] * 7 + [7]) * 2
    windows = [data[i : i + 8] for i in range(0, 63, 8)] * 2
    for i, window_data in enumerate(windows):
        # Equal to the window's own full-batch gradient: no leftover from an earlier window.
        assert_grads_close(opt.grads[i], full_batch_grad(model, opt.params_before[i], window_data))


def test_clipping_applies_once_to_the_whole_window_gradient() -> None:
    w = nn.Parameter(torch.zeros(2, dtype=F64))
    opt = torch.optim.SGD([w], lr=1.0)
    # Loss x . w, mean over the window's 2 samples: weighted micro gradients [2, 0] and [0, 2].
    data = [torch.tensor([[4.0, 0.0]], dtype=F64), torch.tensor([[0.0, 4.0]], dtype=F64)]
    acc = Accumulator(nn.Module(), opt, gradient_accumulation_steps=2, max_grad_norm=1.0)
    for window in acc.windows(data):
        for micro in window:
            micro.backward((micro.batch @ w).mean())
        stats = window.step()

    assert stats.grad_norm is not None
    assert float(stats.grad_norm) == pytest.approx(8**0.5)  # norm of [2, 2] before clipping
    clipped = -w.detach()  # SGD with lr 1 from 0
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6), hence the tolerance.
    torch.testing.assert_close(clipped, torch.tensor([0.5**0.5] * 2, dtype=F64), atol=1e-6, rtol=0)
    # Clipping after each micro-step instead: [2, 0] -> [1, 0]; + [0, 2] -> [1, 2] -> [.447, .894].
    per_step = torch.tensor([1.0, 2.0], dtype=F64) / 5**0.5
    torch.testing.assert_close(
        per_step, torch.tensor([0.4472, 0.8944], dtype=F64), atol=1e-4, rtol=0
    )
    assert (clipped - per_step).abs().max() > 0.2


class RecordingScaler(torch.amp.GradScaler):
    def __init__(self, log: list[str]) -> None:
        super().__init__("cpu", init_scale=8.0)
        self.log = log

    def scale(self, outputs: Any) -> Any:
        self.log.append("scale")
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append("unscale")
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.log.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self.log.append("update")
        super().update(new_scale)


def test_grad_scaler_order_per_window_and_nan_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    scaler = RecordingScaler(log)
    w = nn.Parameter(torch.ones(2, dtype=F64))
    w.register_hook(lambda g: log.append("backward"))
    opt = torch.optim.SGD([w], lr=0.5)
    real_clip = window_module.clip_grad_norm_

    def recording_clip(*args: Any, **kwargs: Any) -> torch.Tensor:
        log.append("clip")
        return real_clip(*args, **kwargs)

    monkeypatch.setattr(window_module, "clip_grad_norm_", recording_clip)
    acc = Accumulator(
        nn.Module(), opt, gradient_accumulation_steps=3, scaler=scaler, max_grad_norm=10.0
    )
    ok = torch.tensor([[1.0, 2.0]], dtype=F64)
    nan = torch.tensor([[float("nan"), 1.0]], dtype=F64)
    results = []
    for window in acc.windows([ok, ok, ok, ok, nan, ok]):
        log.clear()
        w_before = w.detach().clone()
        for micro in window:
            micro.backward((micro.batch @ w).mean())
        results.append((window.step(), list(log), w_before, w.detach().clone()))

    (first, log1, before1, after1), (second, log2, before2, after2) = results
    want_log = ["scale", "backward"] * 3 + ["unscale", "clip", "step", "update"]
    assert log1 == want_log and log2 == want_log
    assert not first.skipped
    torch.testing.assert_close(after1, before1 - 0.5 * torch.tensor([1.0, 2.0], dtype=F64))
    assert first.grad_norm is not None and float(first.grad_norm) == pytest.approx(5**0.5)
    assert second.skipped  # NaN: the step is skipped, the scaler still backs off
    torch.testing.assert_close(after2, before2)
    assert scaler.get_scale() == 4.0
    assert w.grad is None


def test_scheduler_steps_once_per_window() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
    data = make_data([2] * 160)
    stats = train(
        Accumulator(model, opt, gradient_accumulation_steps=10, scheduler=scheduler), data
    )
    assert len(stats) == 16
    assert scheduler.last_epoch == 16
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / 17)


def test_scheduler_after_skipped_first_step_does_not_warn() -> None:
    w = nn.Parameter(torch.ones(1, dtype=F64))
    opt = torch.optim.SGD([w], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = Accumulator(
        nn.Module(),
        opt,
        gradient_accumulation_steps=1,
        scaler=torch.amp.GradScaler("cpu"),
        scheduler=scheduler,
    )
    batches = [torch.tensor([float("nan")], dtype=F64), torch.tensor([1.0], dtype=F64)]
    stats = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for window in acc.windows(batches):
            for micro in window:
                micro.backward((w * micro.batch).mean())
            stats.append(window.step())
    assert [s.skipped for s in stats] == [True, False]
    assert scheduler.last_epoch == 2  # stepped every window, skipped or not


def test_logged_losses_hold_no_graph() -> None:
    model = make_model()
    stats = train(
        Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            gradient_accumulation_steps=2,
            max_grad_norm=1.0,
        ),
        make_data([4, 4, 4]),
    )
    for s in stats:
        assert not s.loss.requires_grad and s.loss.grad_fn is None and s.loss.dim() == 0
        assert s.grad_norm is not None and not s.grad_norm.requires_grad


def test_logged_loss_is_the_mean_over_the_window_samples() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([2, 3, 1, 4, 2])  # windows of 5, 5 and 2 samples; the last has one micro
    stats = train(Accumulator(model, opt, gradient_accumulation_steps=2), data)

    assert [s.num_micro_steps for s in stats] == [2, 2, 1]
    for i, window_data in enumerate([data[0:2], data[2:4], data[4:5]]):
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for p, v in zip(ref.parameters(), opt.params_before[i], strict=True):
                p.copy_(v)
        x = torch.cat([b[0] for b in window_data])
        y = torch.cat([b[1] for b in window_data])
        want = mse(ref, (x, y)).item()
        assert float(stats[i].loss) == pytest.approx(want, rel=1e-12)
        assert stats[i].loss is stats[i].loss  # summed once, on first access


def batch_norm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).to(F64)


def run_one_epoch(model: nn.Module, micro_batch_size: int) -> None:
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), gradient_accumulation_steps=2
    )
    train(acc, make_data([micro_batch_size] * 4))


def test_batch_norm_with_small_micro_batches_warns_once() -> None:
    with pytest.warns(SmallMicroBatchNormWarning, match="4 samples") as record:
        run_one_epoch(batch_norm_model(), 4)
    assert len([r for r in record if r.category is SmallMicroBatchNormWarning]) == 1


@pytest.mark.parametrize(
    ("model_fn", "micro_batch_size"),
    [(batch_norm_model, 32), (make_model, 4), (lambda: batch_norm_model().eval(), 4)],
    ids=["large-micro-batch", "no-batch-norm", "batch-norm-in-eval"],
)
def test_no_batch_norm_warning(model_fn: Callable[[], nn.Module], micro_batch_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_one_epoch(model_fn(), micro_batch_size)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None])
def test_bad_gradient_accumulation_steps(bad: Any) -> None:
    with pytest.raises(ConfigError, match=rf"gradient_accumulation_steps must be .*got {bad!r}"):
        Accumulator(
            nn.Module(),
            torch.optim.SGD([nn.Parameter(torch.ones(1))]),
            gradient_accumulation_steps=bad,
        )


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True])
def test_bad_max_grad_norm(bad: Any) -> None:
    with pytest.raises(ConfigError, match=rf"max_grad_norm must be .*got {bad!r}"):
        Accumulator(
            nn.Module(),
            torch.optim.SGD([nn.Parameter(torch.ones(1))]),
            gradient_accumulation_steps=2,
            max_grad_norm=bad,
        )


def windows_of(batches: list[Any], k: int = 2, **kw: Any) -> Iterator[Any]:
    w = nn.Parameter(torch.ones(1, dtype=F64))
    acc = Accumulator(nn.Module(), torch.optim.SGD([w], lr=0.1), gradient_accumulation_steps=k)
    return acc.windows(batches, **kw)


def test_window_with_zero_total_count_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"window 0 has a total count of 0 .*\[0, 0\]"):
        next(windows_of([torch.ones(3), torch.ones(2)], count_fn=lambda b: 0))


@pytest.mark.parametrize("bad", [-1, 1.5, torch.tensor([1, 2]), torch.tensor(2.0)])
def test_bad_count_fn_value(bad: Any) -> None:
    with pytest.raises(ConfigError, match="count_fn returned"):
        next(windows_of([torch.ones(3)], count_fn=lambda b: bad))


def test_default_count_needs_a_tensor() -> None:
    assert [m.count for m in next(windows_of([{"x": torch.ones(3, 2)}, (torch.ones(5),)]))] == [
        3,
        5,
    ]
    with pytest.raises(ConfigError, match="pass count_fn"):
        next(windows_of([{"text": "no tensor"}]))


def test_misuse_is_reported() -> None:
    w = nn.Parameter(torch.ones(1, dtype=F64))
    acc = Accumulator(nn.Module(), torch.optim.SGD([w], lr=0.1), gradient_accumulation_steps=2)
    windows = acc.windows([torch.ones(1, dtype=F64)] * 4)
    window = next(windows)
    first, _ = list(window)
    first.backward((w * first.batch).mean())
    with pytest.raises(ConfigError, match="already called for micro-step 0"):
        first.backward((w * first.batch).mean())
    with pytest.raises(ConfigError, match="backward ran for 1"):
        window.step()
    with pytest.raises(ConfigError, match=r"window\.step\(\) was not called"):
        next(windows)


def test_mean_loss_of_an_empty_micro_batch_is_rejected() -> None:
    w = nn.Parameter(torch.ones(1, dtype=F64))
    acc = Accumulator(nn.Module(), torch.optim.SGD([w], lr=1.0), gradient_accumulation_steps=2)
    batches = [torch.tensor([2.0], dtype=F64), torch.zeros(0, dtype=F64)]
    for window in acc.windows(batches):
        a, b = list(window)
        a.backward((w * a.batch).mean())
        with pytest.raises(ConfigError, match="reduction='sum'"):
            b.backward((w * b.batch).mean())
        b.backward((w * b.batch).sum(), reduction="sum")
        window.step()
    torch.testing.assert_close(w.detach(), torch.tensor([-1.0], dtype=F64))


def test_a_failed_backward_can_be_retried_without_counting_twice() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([3, 5])
    acc = Accumulator(model, opt, gradient_accumulation_steps=2)
    (window,) = list(itertools.islice(acc.windows(data), 1))
    first, second = list(window)
    fail = [True]

    def oom_once(grad: torch.Tensor) -> torch.Tensor:  # stands in for a CUDA OOM mid-backward
        if fail.pop() if fail else False:
            raise torch.OutOfMemoryError("simulated")
        return grad

    handle = next(model.parameters()).register_hook(oom_once)
    with pytest.raises(torch.OutOfMemoryError):
        first.backward(mse(model, first.batch))
    handle.remove()
    for p in model.parameters():
        p.grad = None  # what an OOM handler does before retrying
    first.backward(mse(model, first.batch))
    second.backward(mse(model, second.batch))
    stats = window.step()

    assert stats.num_micro_steps == 2
    assert_grads_close(opt.grads[0], full_batch_grad(model, opt.params_before[0], data))
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    with torch.no_grad():
        ref = copy.deepcopy(model)
        for p, v in zip(ref.parameters(), opt.params_before[0], strict=True):
            p.copy_(v)
        want = mse(ref, (x, y)).item()
    assert float(stats.loss) == pytest.approx(want, rel=1e-12)


def test_a_loss_with_several_elements_is_refused() -> None:
    w = nn.Parameter(torch.ones(2, dtype=F64))
    acc = Accumulator(nn.Module(), torch.optim.SGD([w], lr=0.1), gradient_accumulation_steps=1)
    (micro,) = next(acc.windows([torch.ones(2, dtype=F64)]))
    with pytest.raises(ConfigError, match=r"loss of shape \(2,\); pass one number"):
        micro.backward(w * micro.batch)
    micro.backward((w * micro.batch).sum(dim=0, keepdim=True), reduction="sum")  # shape (1,)
    assert micro._state.weighted_losses[0].dim() == 0


def test_a_new_loop_does_not_add_gradients_left_by_a_broken_one() -> None:
    model = make_model()
    opt = RecordingSGD(model.parameters())
    data = make_data([2, 3, 4, 1])
    acc = Accumulator(model, opt, gradient_accumulation_steps=2)
    for window in acc.windows(data):
        micro = next(iter(window))
        micro.backward(mse(model, micro.batch))
        break  # e.g. an OOM handler leaves the loop to retry with a smaller micro-batch
    mse(model, data[0]).backward()  # and a stray backward outside the helper
    train(acc, data)
    for i, window_data in enumerate([data[0:2], data[2:4]]):
        assert_grads_close(opt.grads[i], full_batch_grad(model, opt.params_before[i], window_data))


def test_reduce_lr_on_plateau_is_refused() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"scheduler.step\(metric\) yourself"):
        Accumulator(
            model,
            opt,
            gradient_accumulation_steps=2,
            scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
        )


def test_a_step_that_raises_leaves_no_gradient_for_the_next_window() -> None:
    class FailingScheduler(torch.optim.lr_scheduler.LambdaLR):
        armed = False  # LambdaLR steps once when built

        def step(self, epoch: Any = None) -> None:
            if self.armed:
                raise RuntimeError("scheduler failed")
            super().step()

    model = make_model()
    opt = RecordingSGD(model.parameters())
    scheduler = FailingScheduler(opt, lambda _: 1.0)
    scheduler.armed = True
    acc = Accumulator(model, opt, gradient_accumulation_steps=2, scheduler=scheduler)
    with pytest.raises(RuntimeError, match="scheduler failed"):
        train(acc, make_data([2, 3]))
    assert all(p.grad is None for p in model.parameters())


def test_the_logged_loss_of_one_micro_batch_is_its_loss_exactly() -> None:
    model = make_model()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), gradient_accumulation_steps=1
    )
    for window in acc.windows(make_data([49])):  # 49 * (1 / 49) != 1.0 in float64
        (micro,) = window
        loss = mse(model, micro.batch)
        want = loss.item()
        micro.backward(loss)
        assert window.step().loss.item() == want


def test_counts_from_numpy_and_mappings_and_refusals() -> None:
    numpy = pytest.importorskip("numpy")
    windows = windows_of([torch.ones(3)], count_fn=lambda b: numpy.int64(3))
    assert [m.count for m in next(windows)] == [3]
    with pytest.raises(ConfigError, match="dtype torch.bool"):
        next(windows_of([torch.ones(3)], count_fn=lambda b: torch.tensor(True)))
    user_dict = collections.UserDict({"input_ids": torch.ones(4, 7)})  # like BatchEncoding
    assert [m.count for m in next(windows_of([user_dict]))] == [4]
    samples = [(torch.ones(3), torch.ones(1)), (torch.ones(3), torch.ones(1))]
    with pytest.raises(ConfigError, match="looks like a list of samples"):
        next(windows_of([samples]))
    assert [m.count for m in next(windows_of([samples], count_fn=len))] == [2]


class FakeDeepSpeedEngine(nn.Module):
    """A hand-written stand-in for DeepSpeed's engine (DeepSpeed is not installed): it owns
    gradient accumulation: ``backward`` divides each loss by its own accumulation steps, and
    ``step`` updates only at its accumulation boundaries (every ``gas`` calls)."""

    def __init__(self, module: nn.Module, gas: int) -> None:
        super().__init__()
        self.module = module
        self.gas = gas
        self.micro_steps = 0
        self.updates = 0
        self.inner = torch.optim.SGD(module.parameters(), lr=0.1)
        self.param_groups = self.inner.param_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self.inner.step()
            self.inner.zero_grad()
            self.updates += 1
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def test_an_engine_that_owns_accumulation_is_refused_as_the_optimizer() -> None:
    # Passed as the optimizer, the engine would be stepped once per window and update once
    # per 4 of them: 1 update in 16 micro-batches, silently.
    model = make_model()
    engine = FakeDeepSpeedEngine(model, gas=4)
    with pytest.raises(ConfigError, match=r"the optimizer is a FakeDeepSpeedEngine, an engine"):
        Accumulator(model, engine, gradient_accumulation_steps=4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"engine.backward\(loss\); engine.step\(\)"):
        Accumulator(model, engine, gradient_accumulation_steps=4)  # type: ignore[arg-type]


def test_an_engine_that_owns_accumulation_is_refused_as_the_model() -> None:
    engine = FakeDeepSpeedEngine(make_model(), gas=4)
    with pytest.raises(ConfigError, match=r"the model is a FakeDeepSpeedEngine"):
        Accumulator(engine, engine.inner, gradient_accumulation_steps=4)


def test_an_optimizer_from_the_deepspeed_package_is_refused() -> None:
    # DeepSpeed's ZeRO optimizers are stepped by its engine, at its boundaries.
    zero = type("DeepSpeedZeroOptimizer", (torch.optim.SGD,), {"__module__": "deepspeed.zero"})
    model = make_model()
    with pytest.raises(ConfigError, match=r"the optimizer is a DeepSpeedZeroOptimizer"):
        Accumulator(model, zero(model.parameters(), lr=0.1), gradient_accumulation_steps=2)


def test_a_plan_gives_the_steps_and_must_be_for_this_loop() -> None:
    from tests.planning.test_planner import plan

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, plan=plan(16, effective_batch_size=64))
    assert acc.gradient_accumulation_steps == 4
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2 disagrees with the plan"):
        Accumulator(
            model, optimizer, gradient_accumulation_steps=2, plan=plan(16, effective_batch_size=64)
        )
    two_ranks = plan(16, effective_batch_size=128, world_size=2)
    with pytest.raises(
        ConfigError,
        match=r"world_size: the plan is for 2 data-parallel ranks, ",
    ):
        Accumulator(model, optimizer, plan=two_ranks)
