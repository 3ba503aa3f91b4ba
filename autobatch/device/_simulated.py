"""A simulated accelerator: the real step runs on the CPU, its live tensor bytes count against a
capacity, and going over raises torch's ``OutOfMemoryError`` as the CUDA caching allocator does.

Tests, demos and benchmarks use it (``--device sim:2GiB``) to exercise the probe end to end on real
models without a GPU. Every storage counts rounded up to 512 B, the CUDA allocator's smallest
block; there is no cache, so peak reserved equals peak allocated.

Its clock (:meth:`SimulatedDevice.clock`, which the probe times itself with) counts each real step
at ``step_seconds`` rather than the time it took on the CPU, while everything else (the
fake-tensor estimate, clean-ups) counts as it passes: a small ``step_seconds`` puts the probe
where real steps are much cheaper than fake ones (a GPU), a large one where they are dearer (a
CPU), deterministically.

Example::

    device = SimulatedDevice(capacity_bytes=2 * 2**30)
    profile = autobatch.probe(model, sample, device=device)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from autobatch.device._budget import (
    BudgetReading,
    MemoryBudget,
    check_gpu_fraction,
    combine_budget,
    gpu_fraction_reading,
)
from autobatch.device._live_bytes import LiveBytes
from autobatch.device._types import Capacity, PeakMemory
from autobatch.errors import ConfigError
from autobatch.units import format_bytes

__all__ = ["DEFAULT_STEP_SECONDS", "SimulatedDevice"]

DEFAULT_STEP_SECONDS = 1.0
"""Simulated seconds a real step counts by default: a dear step, as a model's real step on a
CPU is (seconds for a GPT-2-sized model, against the estimate's fake steps), so by default the
probe's estimate pays for itself as it does on a CPU. A simulated card named by a string
(``"sim:3GiB"``: the CLI, the service, ``autotune(device=...)``) counts the wall clock instead
(``step_seconds=None``): its steps run on this CPU, and the probe weighs them at what they cost
the user."""


class SimulatedDevice:
    """A device of ``capacity_bytes`` that runs on the CPU and counts live tensor bytes.

    Args:
        capacity_bytes: total memory of the simulated card, bytes (> 0).
        foreign_memory_bytes: bytes "held by another process": the probe may use only
            ``capacity_bytes - foreign_memory_bytes``.
        name: shown in profiles; default ``"sim"``.
        defer_oom: let a step that goes over the capacity run to its end, and raise the
            ``OutOfMemoryError`` when :meth:`measure`'s block exits. The probe uses it for FSDP1
            on several ranks: a backward stopped in the middle would leave FSDP1's per-step
            state broken for the next trial (see :mod:`autobatch.probing._parallel`). The peak
            counted is
            the same either way.
        gpu_fraction: the share of the card this job is declared to get (0 < x <= 1), e.g.
            0.5 for two trials on one card: the budget is ``gpu_fraction * capacity_bytes``
            when that is smaller than what is free. Declared, not enforced: as on a real card,
            a step may go past it, and the probe counts such a step as over the capacity.
        step_seconds: seconds each real step (one :meth:`measure` block) counts on the device's
            :meth:`clock`, instead of the time it took on the CPU (>= 0); None for the wall
            clock.

    Raises:
        ConfigError: a size is not positive, the foreign bytes leave nothing,
            ``gpu_fraction`` is not in (0, 1], or ``step_seconds`` is negative.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int,
        foreign_memory_bytes: int = 0,
        name: str = "sim",
        defer_oom: bool = False,
        gpu_fraction: float | None = None,
        step_seconds: float | None = DEFAULT_STEP_SECONDS,
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes {capacity_bytes} must be > 0, e.g. 2 * 2**30")
        if not 0 <= foreign_memory_bytes < capacity_bytes:
            raise ConfigError(
                f"foreign_memory_bytes {foreign_memory_bytes} must be in [0, {capacity_bytes})"
            )
        self._total = capacity_bytes
        self._foreign = foreign_memory_bytes
        self._name = name
        self._defer_oom = defer_oom
        self._gpu_fraction = check_gpu_fraction(gpu_fraction)
        if step_seconds is not None and not step_seconds >= 0:
            raise ConfigError(f"step_seconds {step_seconds} must be >= 0 (or None: wall clock)")
        self._step_seconds = step_seconds
        self._clock_offset = 0.0
        """Simulated minus wall seconds: each step adds its simulated cost, less its real one."""
        self.num_ooms = 0
        """OutOfMemoryErrors raised so far."""

    @property
    def name(self) -> str:
        return self._name

    @property
    def type(self) -> str:
        return "sim"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def driver_version(self) -> str:
        return ""

    def _budget(self) -> MemoryBudget:
        """The simulated card's free memory and the declared fraction, if any."""
        usable = self._total - self._foreign
        readings = [
            BudgetReading(
                source="simulated",
                total_bytes=self._total,
                available_bytes=usable,
                free_bytes=usable,
                detail=f"{self._foreign} bytes held by another process" if self._foreign else "",
            )
        ]
        if self._gpu_fraction is not None:
            readings.append(gpu_fraction_reading(self._gpu_fraction, self._total))
        return combine_budget(readings)

    def capacity(self) -> Capacity:
        budget = self._budget()
        return Capacity(
            total_memory_bytes=self._total,
            capacity_bytes=budget.budget_bytes,
            foreign_memory_bytes=self._foreign,
            budget=budget,
        )

    def with_gpu_fraction(self, gpu_fraction: float | None) -> SimulatedDevice:
        """This device (same name, memory and OOM behaviour) with ``gpu_fraction`` declared."""
        return SimulatedDevice(
            capacity_bytes=self._total,
            foreign_memory_bytes=self._foreign,
            name=self._name,
            defer_oom=self._defer_oom,
            gpu_fraction=gpu_fraction,
            step_seconds=self._step_seconds,
        )

    def _out_of_memory(self, requested_bytes: int, live_bytes: int) -> torch.OutOfMemoryError:
        self.num_ooms += 1
        usable = self._total - self._foreign
        return torch.OutOfMemoryError(
            # Worded like the CUDA allocator's message, so tools that match on its text
            # (Lightning's is_oom_error, Accelerate's should_reduce_batch_size) see an OOM.
            f"CUDA out of memory. Tried to allocate {format_bytes(requested_bytes)}. "
            f"Simulated device {self._name} has a total capacity of "
            f"{format_bytes(self._total)} of which "
            f"{format_bytes(max(0, usable - live_bytes))} is free; {format_bytes(live_bytes)} "
            "is allocated by tensors."
        )

    @contextmanager
    def measure(self, resident: Sequence[torch.Tensor]) -> Iterator[PeakMemory]:
        """Run the block under a byte counter with the device's capacity; see ``Device``."""
        usable = self._total - self._foreign
        tracker = LiveBytes(
            capacity_bytes=None if self._defer_oom else usable, on_exceeded=self._out_of_memory
        )
        tracker.add_resident(resident)
        peak = PeakMemory()
        started = time.perf_counter()
        try:
            if tracker.live_bytes > usable:
                raise self._out_of_memory(0, tracker.live_bytes)
            with tracker:
                yield peak
        finally:
            peak.allocated_bytes = peak.reserved_bytes = tracker.peak_bytes
            if self._step_seconds is not None:
                self._clock_offset += self._step_seconds - (time.perf_counter() - started)
        if tracker.peak_bytes > usable:  # only with defer_oom: the step ran to its end
            raise self._out_of_memory(tracker.peak_bytes - usable, usable)

    def deferring_oom(self) -> SimulatedDevice:
        """This device (same name and capacity) with ``defer_oom=True``."""
        return SimulatedDevice(
            capacity_bytes=self._total,
            foreign_memory_bytes=self._foreign,
            name=self._name,
            defer_oom=True,
            gpu_fraction=self._gpu_fraction,
            step_seconds=self._step_seconds,
        )

    def release(self) -> None:
        gc.collect()

    def synchronize(self) -> None:
        return None

    @property
    def step_seconds(self) -> float | None:
        """Simulated seconds a real step counts on :meth:`clock`; None: the wall clock."""
        return self._step_seconds

    @property
    def steps_scale_with_size(self) -> bool:
        """True on the wall clock (the steps run on this CPU); False at a set ``step_seconds``."""
        return self._step_seconds is None

    def clock(self) -> float:
        """``time.perf_counter()``, with each real step counted at ``step_seconds``."""
        return time.perf_counter() + self._clock_offset
