"""Peak memory of one whole training step at any micro-batch size, without allocating it.

The step runs on fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes
and devices, no data, no compute) over a fake copy of the model and optimizer, while
:class:`~autobatch.device._live_bytes.LiveBytes` counts the storages alive at each moment. One
warm-up fake step creates the optimizer state (Adam's moments appear at the first step), so every
measured step runs with it present, as in training. A fake step dispatches every op but computes
nothing, so its cost grows with the model's op count, not with the micro-batch: sizes that would
need 100 GiB cost what tiny ones do (``bench/`` reports what a step costs).

The search over sizes is :mod:`autobatch.probing._search` with fake trials, which always finish, so
every point has a known peak.

Example::

    profile = estimate(model, sample, capacity_bytes=80 * 2**30)
    profile.max_micro_batch_size, profile.memory_model
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autobatch.conditions import Conditions
from autobatch.device import LiveBytes
from autobatch.errors import ConfigError, DoesNotFitError, EstimateUnavailableError, Remedy
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.probing._batch import BatchSource
from autobatch.probing._compiled import eager, is_compiled
from autobatch.probing._identity import now_iso
from autobatch.probing._live_conditions import precision_remedies, read_conditions
from autobatch.probing._options import DEFAULT_SEARCH_LIMIT, StepSpec, check_search_arguments
from autobatch.probing._search import (
    Point,
    fit_wide_line,
    next_micro_batch_size,
    recommended_size,
)
from autobatch.probing._snapshot import preserved_rng, resident_tensors
from autobatch.probing._step import LossFn, TrainingStep, TrainStep
from autobatch.profile import Profile, StepIdentity, Trial
from autobatch.units import format_bytes

__all__ = [
    "FakeStep",
    "estimate",
    "estimate_points",
    "optimizer_factory",
    "run_estimate",
]

FIRST_LARGE_SIZE = 64
"""Second size the estimator traces, large enough that activations usually dominate the peak."""


def optimizer_factory(
    optimizer: torch.optim.Optimizer | None,
) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """Builds an optimizer like ``optimizer`` (same class and hyperparameters) over new params;
    AdamW with defaults when ``optimizer`` is None."""
    if optimizer is None:
        return lambda groups: torch.optim.AdamW(groups)
    cls: type[Any] = type(optimizer)
    defaults = dict(optimizer.defaults)

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        try:
            built: torch.optim.Optimizer = cls(groups, **defaults)
            return built
        except TypeError:  # a custom optimizer whose constructor takes fewer keywords
            fallback: torch.optim.Optimizer = cls(groups)
            return fallback

    return build


class FakeStep:
    """A fake copy of model and optimizer on which :meth:`peak_bytes` traces one step.

    Raises:
        EstimateUnavailableError: from the constructor or :meth:`peak_bytes` when the model or step
            cannot run on fake tensors.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        source: BatchSource,
        *,
        loss_fn: LossFn | None = None,
        train_step: TrainStep | None = None,
        step_includes_update: bool = False,
        amp_dtype: torch.dtype | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.source = source
        try:
            memo: dict[int, Any] = {}
            for param in model.parameters():
                if id(param) not in memo:
                    fake = self.mode.from_tensor(param.detach())
                    memo[id(param)] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
            for buffer in model.buffers():
                memo.setdefault(id(buffer), self.mode.from_tensor(buffer))
            self.model: torch.nn.Module = copy.deepcopy(model, memo)
            groups = _fake_groups(model, self.model, optimizer)
            self.optimizer = optimizer_factory(optimizer)(groups)
        except Exception as exc:  # any failure to build the copy means "no estimate"
            raise EstimateUnavailableError(
                f"cannot copy the model onto fake tensors: {exc}"
            ) from exc
        self.step = TrainingStep(
            self.model,
            self.optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
            amp_dtype=amp_dtype,
            grad_scaler=_fake_scaler(amp_dtype, model),
            step_on_overflow=True,
        )
        self.num_steps = 0
        self.clock = clock
        """Seconds on a monotonic clock, read before and after each fake step."""
        self.step_seconds: list[float] = []
        """Each fake step's time on :attr:`clock` (the warm-up's first), seconds."""
        self.stopped_early = False
        """:func:`estimate_points` stopped at its time budget before the boundary was found."""
        self.min_micro_batch_size = 1
        """Smallest size the step can train at (2 when BatchNorm refuses one sample)."""
        self._warmed_up = False

    @classmethod
    def of(cls, step: StepSpec) -> FakeStep:
        """A fake copy of ``step``'s model and optimizer, running ``step``'s training step."""
        return cls(
            step.model,
            step.optimizer,
            step.source,
            loss_fn=step.loss_fn,
            train_step=step.train_step,
            step_includes_update=step.step_includes_update,
            amp_dtype=step.amp_dtype,
        )

    def warm_up(self) -> None:
        """One fake step to create the optimizer state, once; at micro-batch 2 when 1 cannot
        train (BatchNorm needs more than one value per channel)."""
        if self._warmed_up:
            return
        started = self.clock()
        try:
            with self._tracing(LiveBytes()):
                self.step.run(self.source.make(1))
        except EstimateUnavailableError as exc:
            if "Expected more than 1 value per channel" not in str(exc):
                raise
            self.min_micro_batch_size = 2
            with self._tracing(LiveBytes()):
                self.step.run(self.source.make(2))
        self.num_steps += 1
        self.step_seconds.append(self.clock() - started)
        self._warmed_up = True

    def resident(self) -> list[torch.Tensor]:
        """Tensors alive between steps: parameters, buffers, optimizer state."""
        return resident_tensors(self.model, self.optimizer)

    @contextmanager
    def _tracing(self, tracker: LiveBytes) -> Iterator[None]:
        # FakeTensorMode logs a full traceback for every op that fails; the failure is reported
        # once, as EstimateUnavailableError (or the step's own error), instead.
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        level = fake_log.level
        fake_log.setLevel(logging.CRITICAL)
        try:
            with eager(), self.mode, tracker:
                yield
        except ConfigError:
            raise
        except Exception as exc:
            raise EstimateUnavailableError(
                f"the step cannot run on fake tensors: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            fake_log.setLevel(level)

    def peak_bytes(self, micro_batch_size: int) -> int:
        """Peak live bytes of one step at ``micro_batch_size`` (optimizer state present).

        Raises:
            ConfigError: the step itself is misconfigured (e.g. no loss); see TrainingStep.
            EstimateUnavailableError: the step cannot run on fake tensors.
        """
        self.warm_up()
        started = self.clock()
        tracker = LiveBytes()
        tracker.add_resident(self.resident())
        with self._tracing(tracker):
            self.step.run(self.source.make(micro_batch_size))
        self.num_steps += 1
        self.step_seconds.append(self.clock() - started)
        return tracker.peak_bytes


def _fake_groups(
    model: torch.nn.Module, fake_model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[dict[str, Any]]:
    fake_of = {
        id(real): fake
        for real, fake in zip(model.parameters(), fake_model.parameters(), strict=True)
    }
    if optimizer is None:
        return [{"params": [p for p in fake_model.parameters() if p.requires_grad]}]
    groups = []
    for group in optimizer.param_groups:
        fake_group = {k: v for k, v in group.items() if k != "params"}
        fake_group["params"] = [fake_of[id(p)] for p in group["params"] if id(p) in fake_of]
        groups.append(fake_group)
    return groups


def _fake_scaler(amp_dtype: torch.dtype | None, model: torch.nn.Module) -> Any:
    if amp_dtype != torch.float16:
        return None
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    return torch.amp.GradScaler(device_type)


def estimate(
    model: torch.nn.Module,
    sample: Any,
    *,
    capacity_bytes: int,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    step_includes_update: bool = False,
    amp_dtype: torch.dtype | None = None,
    max_micro_batch_size: int = DEFAULT_SEARCH_LIMIT,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    device_name: str = "estimate",
) -> Profile:
    """Largest micro-batch whose training step fits in ``capacity_bytes``, on fake tensors.

    Nothing is allocated beyond a fake copy's bookkeeping and nothing is computed; the model and
    optimizer are not touched. Peak bytes count live tensor storages rounded to 512 B blocks, like
    the CUDA caching allocator's allocated bytes; they exclude the CUDA context and library
    workspaces (the probe measures those).

    Args:
        model: the model (any device).
        sample: one batch (tensor, or tuple/list/dict of tensors, batch dimension first) or a
            callable ``n -> batch``; see :mod:`autobatch.probing._batch`.
        capacity_bytes: bytes the step may use (> 0).
        optimizer: its class and hyperparameters are used; AdamW when None.
        loss_fn, train_step, step_includes_update: how the sample becomes a step, see
            :mod:`autobatch.probing._step`.
        amp_dtype: autocast dtype, None for none.
        max_micro_batch_size: the search cap, the largest micro-batch considered (>= 1); not
            the measured maximum (the returned profile's ``max_micro_batch_size``).
        safety_margin: fraction of capacity the recommended size keeps free (0 <= x < 1).
        device_name: recorded in the profile.

    Returns:
        A Profile with ``method="estimate"``; trials are fake (``step_seconds == 0``).

    Raises:
        ConfigError: a bad argument or sample (names the value).
        EstimateUnavailableError: the step cannot run on fake tensors.
        DoesNotFitError: not even micro-batch 1 fits in ``capacity_bytes``.
    """
    if (
        isinstance(capacity_bytes, bool)
        or not isinstance(capacity_bytes, int)
        or capacity_bytes <= 0
    ):
        raise ConfigError(f"capacity_bytes {capacity_bytes!r} must be a positive int of bytes")
    check_search_arguments(max_micro_batch_size, safety_margin)
    step = StepSpec.build(
        model,
        sample,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_step=train_step,
        step_includes_update=step_includes_update,
        amp_dtype=amp_dtype,
    )
    if step_includes_update:
        raise EstimateUnavailableError(
            "a train_step that updates by itself (step_includes_update=True) steps your own "
            "optimizer over the real parameters, so it cannot run on a fake copy of the model; "
            "use autobatch.probe, or pass a train_step that only returns the loss"
        )
    # Nothing real is computed, but a train_step that closes over the real model can still
    # assign (fake) gradients to it, and the user's code may draw random numbers.
    grads = [(param, param.grad) for param in model.parameters()]
    conditions = read_conditions(model, optimizer, device_type="fake", amp_dtype=amp_dtype)
    try:
        with preserved_rng():
            profile = run_estimate(
                FakeStep.of(step),
                identity=step.identity,
                conditions=conditions,
                capacity_bytes=capacity_bytes,
                search_limit=max_micro_batch_size,
                safety_margin=safety_margin,
                device_name=device_name,
            )
    finally:
        for param, grad in grads:
            param.grad = grad
    notes = profile.notes
    if is_compiled(model):
        notes += ("torch.compile: estimated on the uncompiled step (fake tensors)",)
    return dataclasses.replace(profile, notes=notes, model_name=step.model_name)


def estimate_points(
    fake: FakeStep,
    *,
    capacity_bytes: int,
    search_limit: int,
    budget_seconds: float | None = None,
) -> list[Point]:
    """Fake trials until the boundary under ``capacity_bytes`` is found (see module doc).

    Args:
        fake: the fake step.
        capacity_bytes, search_limit: the search's capacity and its cap (the largest size tried).
        budget_seconds: the most the fake steps may take in all (None: no bound). No fake step
            starts when the steps so far plus one more of their mean length would exceed it; the
            search then stops (``fake.stopped_early``), its points so far returned. The warm-up
            fake step always runs.
    """
    points: list[Point] = []
    fake.warm_up()
    size: int | None = min(fake.min_micro_batch_size, search_limit)
    while size is not None:
        spent = sum(fake.step_seconds)
        if budget_seconds is not None and spent + spent / len(fake.step_seconds) > budget_seconds:
            fake.stopped_early = True
            break
        peak = fake.peak_bytes(size)
        points.append(Point(micro_batch_size=size, fits=peak <= capacity_bytes, peak_bytes=peak))
        if len(points) == 1 and points[0].fits:
            size = min(FIRST_LARGE_SIZE, search_limit)
            if size <= points[0].micro_batch_size:
                break
            continue
        size = next_micro_batch_size(
            points,
            capacity_bytes=capacity_bytes,
            limit=search_limit,
            prior=None,
            failures_follow_peaks=True,  # fake steps always finish: their peaks are the truth
        )
    return points


def run_estimate(
    fake: FakeStep,
    *,
    identity: StepIdentity,
    conditions: Conditions,
    capacity_bytes: int,
    search_limit: int,
    safety_margin: float,
    device_name: str,
) -> Profile:
    """:func:`estimate`'s search on ``fake``, as a Profile of ``identity`` measured under
    ``conditions``. (The probe does not call it: it runs :func:`estimate_points` for a prior and
    a first size.)

    Raises:
        DoesNotFitError: not even micro-batch 1 fits in ``capacity_bytes``.
    """
    started = time.perf_counter()
    points = estimate_points(fake, capacity_bytes=capacity_bytes, search_limit=search_limit)
    seconds = time.perf_counter() - started
    fitting = [p.micro_batch_size for p in points if p.fits]
    if not fitting:
        need = points[0].peak_bytes
        raise DoesNotFitError(
            f"the training step needs about {format_bytes(need)} at micro-batch 1 but the "
            f"capacity is {format_bytes(capacity_bytes)}",
            remedies=(
                Remedy(purpose="a larger device"),
                *precision_remedies(conditions),
                Remedy(purpose="a smaller model"),
            ),
            device_name=device_name,
            capacity_bytes=capacity_bytes,
            required_bytes=need,
            static_bytes=sum(t.untyped_storage().nbytes() for t in fake.resident()),
        )
    largest = max(fitting)
    # The line a probe stores (far-apart sizes, fixed bytes never negative), not the search's
    # secant through its two latest sizes, which one allocation's rounding tilts.
    model_line = fit_wide_line(points)
    trials = tuple(
        Trial(
            micro_batch_size=p.micro_batch_size,
            fits=p.fits,
            peak_allocated_bytes=p.peak_bytes,
            peak_reserved_bytes=p.peak_bytes,
            error="" if p.fits else "over capacity (estimated)",
        )
        for p in points
    )
    return Profile(
        max_micro_batch_size=largest,
        recommended_micro_batch_size=recommended_size(
            points, capacity_bytes=capacity_bytes, safety_margin=safety_margin, model=model_line
        ),
        safety_margin=safety_margin,
        method="estimate",
        trials=trials,
        num_steps=fake.num_steps,
        device_name=device_name,
        device_type="fake",
        total_memory_bytes=capacity_bytes,
        capacity_bytes=capacity_bytes,
        memory_model=model_line,
        stop_kind="limit" if largest >= search_limit else "boundary",
        stop_reason=(
            f"limit max_micro_batch_size={search_limit} reached"
            if largest >= search_limit
            else f"size {largest + 1} is over capacity"
        ),
        notes=(f"estimated on fake tensors in {seconds:.1f} s",),
        identity=identity,
        created_at=now_iso(),
        conditions=conditions,
    )
