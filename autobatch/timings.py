"""Where a probe's time went: the estimate's fake steps, the real trials, the clean-up after
each failure (:class:`ProbeTimings`, recorded on the profile). Imports neither torch nor pynvml.

Example::

    profile.timings.describe()
    # "17.3 s: estimate 2.28 s (6 fake steps), 4 real trials 14.9 s, ..."
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from autobatch.errors import ConfigError

__all__ = ["Clock", "ProbeTimings"]

Clock = Literal["wall", "simulated"]
"""How a probe's seconds were counted: as they passed, or on a simulated card's clock."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeTimings:
    """Where a probe's time went, in seconds: real steps read from the device's clock
    (:meth:`autobatch.device.Device.clock`), the estimate's fake steps (which run on the host)
    from the probe's (``ProbeOptions.clock``, the wall clock unless a test sets one).

    On a real device the clock is the wall clock; on a
    :class:`~autobatch.device.SimulatedDevice` given ``step_seconds`` each real step counts that
    many simulated seconds instead of the time it took on the CPU (``clock="simulated"``), so
    tests and benchmarks can put the probe where real steps are cheap (a GPU) or dear (a CPU).
    """

    total_seconds: float
    """The whole search: capacity, estimate, real trials and their clean-ups."""
    estimate_seconds: float = 0.0
    """The fake-tensor estimate in all (the fake copy of model and optimizer, every fake step);
    0 when it did not run."""
    fake_step_seconds: tuple[float, ...] = ()
    """Each fake step of the estimate, in order (its warm-up step first)."""
    trial_seconds: tuple[float, ...] = ()
    """Each real trial, in the order of :attr:`Profile.trials` (warm-up and second steps
    included, failed steps too), without the clean-up after a failure."""
    cleanup_seconds: tuple[float, ...] = ()
    """The clean-up after each real trial (gradients dropped, ``gc.collect()``, the allocator
    cache emptied), in the order of :attr:`Profile.trials`; 0 where the step fitted."""
    clock: Clock = "wall"
    """``"wall"``: seconds as they passed; ``"simulated"``: real steps counted at a simulated
    device's ``step_seconds``."""

    def __post_init__(self) -> None:
        if len(self.cleanup_seconds) != len(self.trial_seconds):
            raise ConfigError(
                f"timings: {len(self.cleanup_seconds)} clean-up times for "
                f"{len(self.trial_seconds)} trials; give one per trial (0 where none ran)"
            )
        values = (
            self.total_seconds,
            self.estimate_seconds,
            *self.fake_step_seconds,
            *self.trial_seconds,
            *self.cleanup_seconds,
        )
        if any(v < 0 for v in values):
            raise ConfigError(f"timings: seconds must be >= 0, got {min(values)}")

    @property
    def real_seconds(self) -> float:
        """The real trials and their clean-ups."""
        return sum(self.trial_seconds) + sum(self.cleanup_seconds)

    def describe(self) -> str:
        """One line, e.g. ``"3.1 s: estimate 2.0 s (6 fake steps), 4 real trials 1.0 s, clean-up
        after 1 failure 0.1 s"``."""
        parts = []
        if self.fake_step_seconds or self.estimate_seconds:
            fake = _counted(len(self.fake_step_seconds), "fake step")
            parts.append(f"estimate {self.estimate_seconds:.3g} s ({fake})")
        parts.append(
            f"{_counted(len(self.trial_seconds), 'real trial')} {sum(self.trial_seconds):.3g} s"
        )
        cleanups = [c for c in self.cleanup_seconds if c > 0]
        if cleanups:
            parts.append(
                f"clean-up after {_counted(len(cleanups), 'failure')} {sum(cleanups):.3g} s"
            )
        clock = " (simulated clock)" if self.clock == "simulated" else ""
        return f"{self.total_seconds:.3g} s{clock}: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ProbeTimings | None:
        """None for a profile that did not record them (written before, or an estimate)."""
        if data is None:
            return None
        fields = dict(data)
        for key in ("fake_step_seconds", "trial_seconds", "cleanup_seconds"):
            fields[key] = tuple(fields.get(key, ()))
        return cls(**fields)


def _counted(count: int, noun: str) -> str:
    """``"1 failure"``, ``"3 failures"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
