"""``autobatch tune``'s progress line on stderr: the probe's stage (warm-up, estimate, trials,
confirm), a clock that ticks while a stage runs, the last trial, and how many real trials are
left at most (the search's bound, :class:`autobatch.probing.ProbeStage`).

:class:`ProbeDisplay` is the text alone, from the probe's events (pure: tests feed it a sequence
of events); :class:`Progress` draws it with tqdm, redrawn every second by a ticker thread so the
elapsed clock moves during a long stage (an estimate of a large model on a CPU: minutes without
an event). Warnings raised during the probe are written above the line, never glued onto it.
When stderr is not a terminal (a log file, CI, ``kubectl logs``) nothing is redrawn: each
event (a stage starting, a trial ending) is written as a line of its own, and no clock ticks.

Example::

    progress = Progress(enabled=True, word=str)
    tune_request(TuneRequest.build(..., on_trial=progress.trial, on_stage=progress.stage))
    progress.close()
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from autobatch.units import format_bytes

if TYPE_CHECKING:  # the probe is torch-bound: only the commands that run a step load torch
    from autobatch.probing import ProbeStage

__all__ = ["STAGE_WORDS", "ProbeDisplay", "Progress", "ProgressLog"]

STAGE_WORDS = {
    "warm-up": "warm-up (micro-batch 1: creates the optimizer state)",
    "estimate": "estimate (fake tensors: CPU time, no real step)",
    "trials": "trials",
    "confirm": "confirm (the chosen size's second step)",
    "timing": "timing (the plan's micro-batch, 3 trials)",
}
"""What each stage is, as the line shows it."""

TICK_SECONDS = 1.0
"""How often the line is redrawn while nothing happens (tqdm's elapsed clock moves then)."""


class ProbeDisplay:
    """The progress line's text from a probe's events: the stage, the trials so far and the
    last one, and the trials left at most."""

    def __init__(self, *, name_modes: bool = False) -> None:
        self._stage: ProbeStage | None = None
        self._num_trials = 0
        self._since_stage = 0
        self._last = ""
        self._name_modes = name_modes

    def stage(self, event: ProbeStage) -> None:
        """A stage starts (:data:`autobatch.probing.OnStage`)."""
        self._stage = event
        self._since_stage = 0

    def trial(self, trial: Any) -> None:
        """A real trial ended (:data:`autobatch.probing.OnTrial`)."""
        self._num_trials += 1
        self._since_stage += 1
        outcome = "fits" if trial.fits else ("OOM" if trial.oom else "too big")
        peak = f", peak {format_bytes(trial.peak_reserved_bytes)}" if trial.fits else ""
        self._last = f"micro-batch {trial.micro_batch_size} {outcome}{peak}"

    def text(self) -> str:
        """E.g. ``probing, trials: 3 trials (micro-batch 64 fits, peak 96.50 KiB); at most 16
        left``; with the modes named (``--activation-checkpointing`` other than ``none``):
        ``probing with full checkpointing, trials: ...``. The trials are counted over the
        whole command; what is left, over the probe running now (each mode's its own)."""
        event = self._stage
        stage = "starting" if event is None else STAGE_WORDS[event.stage]
        count = f"{self._num_trials} trial{'' if self._num_trials == 1 else 's'}"
        last = f" ({self._last})" if self._last else ""
        left = ""
        if event is not None:
            ran = event.trials_run + self._since_stage
            left = f"; at most {max(0, event.max_trials - ran)} left"
        mode = ""
        if self._name_modes and event is not None:
            checkpointing = event.checkpointing_mode
            mode = (
                " without checkpointing"
                if checkpointing == "none"
                else f" with {checkpointing} checkpointing"
            )
        return f"probing{mode}, {stage}: {count}{last}{left}"


class Progress:
    """The tqdm line of one probe on stderr; silent when disabled (``--json``, configs). On a
    stderr that is not a terminal, a line an event instead (no redraw, no ticking clock).

    Args:
        enabled: draw the line (the text output); False draws nothing.
        word: how a warning's message reads on this command line (the CLI's wording).
        name_modes: name each probe's activation checkpointing mode on the line (several
            modes may be probed: ``--activation-checkpointing`` other than ``none``).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        word: Callable[[Warning | str], str] = str,
        name_modes: bool = False,
    ) -> None:
        self._enabled = enabled
        self._word = word
        self._display = ProbeDisplay(name_modes=name_modes)
        self._bar: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()

    def stage(self, event: ProbeStage) -> None:
        self._display.stage(event)
        self._draw()

    def trial(self, trial: Any) -> None:
        self._display.trial(trial)
        self._draw()

    def warning(self, message: Warning | str) -> None:
        """Write a warning above the line (``autobatch: warning: ...``), in the CLI's words."""
        line = f"autobatch: warning: {self._word(message)}"
        if self._bar is None:
            print(line, file=sys.stderr)
            return
        from tqdm import tqdm

        with self._lock:
            tqdm.write(line, file=sys.stderr)

    def _draw(self) -> None:
        if not self._enabled:
            return
        if not _is_terminal(sys.stderr):  # a log file: one line an event, no carriage return
            with self._lock:
                print(self._display.text(), file=sys.stderr, flush=True)
            return
        with self._lock:
            if self._bar is None:  # at the first event: a cached answer shows no line
                from tqdm import tqdm

                self._bar = tqdm(
                    desc=self._display.text(),
                    file=sys.stderr,
                    leave=True,
                    bar_format="{desc} [{elapsed}]",
                )
                self._ticker = threading.Thread(target=self._tick, daemon=True)
                self._ticker.start()
            self._bar.set_description_str(self._display.text())

    def _tick(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            with self._lock:
                self._bar.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a redrawn line reads well there, not in a file)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


class ProgressLog(logging.Handler):
    """The ``autobatch`` logger's warnings during a probe, written as :meth:`Progress.warning`
    writes warnings (above the line, in the CLI's words), not glued onto the line.

    Example::

        with ProgressLog.attached(progress):
            tune_request(...)
    """

    def __init__(self, progress: Progress) -> None:
        super().__init__(level=logging.WARNING)
        self._progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self._progress.warning(record.getMessage())

    @classmethod
    @contextlib.contextmanager
    def attached(cls, progress: Progress) -> Iterator[None]:
        """Route the ``autobatch`` logger's warnings to ``progress`` while the block runs."""
        logger = logging.getLogger("autobatch")
        handler = cls(progress)
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)
