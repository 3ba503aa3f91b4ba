"""Clocks for the probe's host side (``ProbeOptions.clock``) that advance by set amounts, so a
test's outcome does not depend on how fast or loaded the machine is.

Example::

    clock = TickingClock(seconds=0.001)
    ProbeOptions.build(step, device=device, clock=clock)  # each fake step lasts 1 ms
"""

from __future__ import annotations


class TickingClock:
    """Each reading is ``seconds`` after the one before: a fake step, read once before and
    once after, lasts exactly ``seconds``."""

    def __init__(self, *, seconds: float) -> None:
        self.seconds = seconds
        self.now = 0.0

    def __call__(self) -> float:
        reading = self.now
        self.now += self.seconds
        return reading


class SetClock:
    """A clock that stands still until :meth:`advance` moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __deepcopy__(self, memo: dict[int, object]) -> SetClock:
        return self  # a fake copy of a model that holds this clock advances this same clock
