"""A tuning as a picture: a self-contained HTML page (inline SVG, no script, no external asset)
with peak memory against micro-batch for each activation checkpointing mode beside the budget
line, time per sample, every trial (OOMs marked) and the chosen point; and the same data as a
JSON-ready dict (:func:`report_data`).

The chosen point is ``<circle id="chosen-point" class="chosen">`` in the memory chart; each
trial is a ``<circle class="trial fits">`` or a ``<g class="trial oom">`` cross drawn at the
budget line (an OOM has no peak), each carrying ``data-mode`` and ``data-micro-batch-size``.

Example::

    Path("report.html").write_text(report_html(tuning))
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Callable
from typing import Any

from autobatch.planning import mode_report
from autobatch.profile import Profile
from autobatch.tuning._tune import Tuning
from autobatch.units import format_bytes

__all__ = ["report_data", "report_html"]

_COLOURS = {"none": "#1f77b4", "selective": "#2ca02c", "full": "#d62728"}
_WIDTH, _HEIGHT, _PAD = 640, 320, 56


def _runs(tuning: Tuning) -> list[tuple[str, Profile]]:
    """(mode, profile) of every mode probed: the outcome's runs, each with the trial that timed
    its plan's micro-batch among its trials (:class:`autobatch.tuning.ModeRun`), or the one
    profile."""
    if tuning.checkpointing is None:
        return [(tuning.profile.activation_checkpointing, tuning.profile)]
    return [
        (run.mode, dataclasses.replace(run.profile, trials=(*run.profile.trials, *run.timing)))
        for run in tuning.checkpointing.runs
        if run.profile
    ]


def report_data(tuning: Tuning) -> dict[str, Any]:
    """The report's data: per mode its trials (:func:`autobatch.planning.mode_report`), the
    budget in bytes, and the chosen point (mode, micro-batch, accumulation steps, predicted peak
    bytes); a stored profile's alone is :func:`autobatch.planning.profile_report`."""
    plan = tuning.plan
    modes = [mode_report(mode, profile) for mode, profile in _runs(tuning)]
    outcome = tuning.checkpointing
    return {
        "capacity_bytes": tuning.profile.capacity_bytes,
        "modes": modes,
        "chosen": {
            "activation_checkpointing": plan.activation_checkpointing,
            "micro_batch_size": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.gradient_accumulation_steps,
            "predicted_peak_memory_bytes": plan.predicted_peak_memory_bytes,
        },
        "why": [] if outcome is None else outcome.notes(),
    }


class _Axes:
    """Data to SVG coordinates: x the micro-batch, y from 0 to ``top``."""

    def __init__(self, largest: int, top: float) -> None:
        self.largest, self.top = max(largest, 1), top if top > 0 else 1.0

    def x(self, size: int) -> float:
        return _PAD + (_WIDTH - 2 * _PAD) * size / self.largest

    def y(self, value: float) -> float:
        return _HEIGHT - _PAD - (_HEIGHT - 2 * _PAD) * value / self.top


def _ticks(top: float, *, whole: bool = False, unit: float = 1.0) -> list[float]:
    """About 4 evenly spaced round values from 0 up to ``top``: 1, 2 or 5 times a power of ten
    of ``unit`` apart (bytes: a power of 1024, so ticks read 1, 2, 3 MiB); whole numbers when
    ``whole``."""
    if top <= 0:
        return [0.0]
    rough = top / unit / 4
    power = 10 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
    if whole:
        step = max(1.0, float(round(step)))
    return [i * step * unit for i in range(int(top / unit // step) + 1)]


def _byte_unit(top: float) -> float:
    """The power of 1024 the byte axis counts in (KiB, MiB, GiB...)."""
    return float(1024 ** max(0, math.floor(math.log(max(top, 1.0), 1024))))


def _frame(
    title: str, axes: _Axes, y_label: str, y_text: Callable[[float], str], *, y_unit: float = 1.0
) -> list[str]:
    """The chart's frame: title, axes, ticks labelled (micro-batch below, ``y_text`` of each
    value at the left) and the axis labels."""
    bottom, right = _HEIGHT - _PAD, _WIDTH - _PAD
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<text x="{_PAD}" y="20" font-size="14">{html.escape(title)}</text>',
        f'<line x1="{_PAD}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{bottom}" stroke="black"/>',
        f'<text x="{right}" y="{bottom + 32}" text-anchor="end" font-size="12">micro-batch '
        f"(largest {axes.largest})</text>",
        f'<text x="4" y="{_PAD - 12}" font-size="12">{html.escape(y_label)}</text>',
    ]
    for size in _ticks(axes.largest, whole=True):
        x = axes.x(int(size))
        parts.append(
            f'<g class="tick x"><line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" '
            f'stroke="black"/><text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle" '
            f'font-size="10">{int(size)}</text></g>'
        )
    for value in _ticks(axes.top, unit=y_unit):
        y = axes.y(value)
        parts.append(
            f'<g class="tick y"><line x1="{_PAD - 4}" y1="{y:.1f}" x2="{_PAD}" y2="{y:.1f}" '
            f'stroke="black"/><text x="{_PAD - 6}" y="{y + 3:.1f}" text-anchor="end" '
            f'font-size="10">{html.escape(y_text(value))}</text></g>'
        )
    return parts


def _memory_svg(data: dict[str, Any]) -> str:
    sizes = [t["micro_batch_size"] for m in data["modes"] for t in m["trials"]]
    budget = data["capacity_bytes"]
    axes = _Axes(max(sizes, default=1), budget * 1.15)
    parts = _frame(
        "peak memory against micro-batch",
        axes,
        f"peak memory (budget {format_bytes(budget)})",
        lambda value: _short_bytes(int(value)),
        y_unit=_byte_unit(axes.top),
    )
    y = axes.y(budget)
    parts.append(
        f'<line id="budget-line" x1="{_PAD}" y1="{y:.1f}" x2="{_WIDTH - _PAD}" y2="{y:.1f}" '
        f'stroke="black" stroke-dasharray="6 4"/><text x="{_WIDTH - _PAD}" y="{y - 4:.1f}" '
        f'text-anchor="end" font-size="11">budget {format_bytes(budget)}</text>'
    )
    for mode in data["modes"]:
        colour = _COLOURS[mode["mode"]]
        for t in mode["trials"]:
            where = f'data-mode="{mode["mode"]}" data-micro-batch-size="{t["micro_batch_size"]}"'
            cx = axes.x(t["micro_batch_size"])
            if t["fits"]:
                cy = axes.y(t["peak_memory_bytes"])
                parts.append(
                    f'<circle class="trial fits" {where} cx="{cx:.1f}" cy="{cy:.1f}" r="4" '
                    f'fill="{colour}"><title>{mode["mode"]} {t["micro_batch_size"]}: '
                    f"{format_bytes(t['peak_memory_bytes'])}</title></circle>"
                )
            else:
                parts.append(
                    f'<g class="trial oom" {where} stroke="{colour}" stroke-width="2">'
                    f'<line x1="{cx - 5:.1f}" y1="{y - 5:.1f}" x2="{cx + 5:.1f}" y2="{y + 5:.1f}"/>'
                    f'<line x1="{cx - 5:.1f}" y1="{y + 5:.1f}" x2="{cx + 5:.1f}" y2="{y - 5:.1f}"/>'
                    f"<title>{mode['mode']} {t['micro_batch_size']}: OOM</title></g>"
                )
    chosen = data["chosen"]
    peak = chosen["predicted_peak_memory_bytes"] or budget
    mode, size = chosen["activation_checkpointing"], chosen["micro_batch_size"]
    label = f"chosen: {_plan_words(chosen)}"
    cx, cy = axes.x(size), axes.y(peak)
    anchor = "end" if cx > _WIDTH / 2 else "start"
    parts.append(
        f'<circle id="chosen-point" class="chosen" data-mode="{mode}" '
        f'data-micro-batch-size="{size}" cx="{cx:.1f}" cy="{cy:.1f}" '
        'r="9" fill="none" stroke="black" stroke-width="2">'
        f"<title>{html.escape(label)}</title></circle>"
        f'<text id="chosen-label" x="{cx + (-12 if anchor == "end" else 12):.1f}" '
        f'y="{cy + 18:.1f}" text-anchor="{anchor}" font-size="11">{html.escape(label)}</text>'
    )
    parts.append("</svg>")
    return "\n".join(parts)


def _time_svg(data: dict[str, Any]) -> str:
    timed = [
        (m["mode"], t)
        for m in data["modes"]
        for t in m["trials"]
        if t["seconds_per_sample"] is not None
    ]
    axes = _Axes(
        max((t["micro_batch_size"] for _, t in timed), default=1),
        max((t["seconds_per_sample"] for _, t in timed), default=1.0) * 1.15,
    )
    parts = _frame(
        "time per sample against micro-batch (measured)",
        axes,
        "seconds per sample",
        lambda value: f"{value:.3g} s",
    )
    for mode, t in timed:
        parts.append(
            f'<circle class="timing" data-mode="{mode}" cx="{axes.x(t["micro_batch_size"]):.1f}" '
            f'cy="{axes.y(t["seconds_per_sample"]):.1f}" r="4" fill="{_COLOURS[mode]}">'
            f"<title>{mode} {t['micro_batch_size']}: {t['seconds_per_sample']:.4g} s</title>"
            "</circle>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _short_bytes(num_bytes: int) -> str:
    """``format_bytes`` without trailing zeros, for a tick: ``"1.5 GiB"``, ``"0 B"``."""
    number, _, unit = format_bytes(num_bytes).partition(" ")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return f"{number} {unit}"


def _plan_words(chosen: dict[str, Any]) -> str:
    """The chosen plan in words: ``"full, micro-batch 16 × 4 steps"`` (``"micro-batch 16"``
    where no accumulation was planned)."""
    steps = chosen["gradient_accumulation_steps"]
    size = f"micro-batch {chosen['micro_batch_size']}"
    if steps is not None:
        size += f" \u00d7 {steps} step{'' if steps == 1 else 's'}"
    return f"{chosen['activation_checkpointing']}, {size}"


def _row(mode: str, trial: dict[str, Any]) -> str:
    result = "OOM" if trial["oom"] else ("fits" if trial["fits"] else "failed")
    peak = trial["peak_memory_bytes"]
    seconds = trial["seconds_per_sample"]
    return (
        f"<tr><td>{mode}</td><td>{trial['micro_batch_size']}</td><td>{result}</td>"
        f"<td>{'' if peak is None else format_bytes(peak)}</td>"
        f"<td>{'' if seconds is None else f'{seconds:.4g} s'}</td></tr>"
    )


def report_html(tuning: Tuning) -> str:
    """The report page of ``tuning`` (see the module docstring), as one HTML string."""
    data = report_data(tuning)
    chosen = data["chosen"]
    legend = " ".join(
        f'<span style="color:{_COLOURS[m["mode"]]}">&#9679; {m["mode"]}</span>'
        for m in data["modes"]
    )
    rows = "".join(_row(m["mode"], t) for m in data["modes"] for t in m["trials"])
    why = "".join(f"<li>{html.escape(line)}</li>" for line in data["why"])
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>autobatch tuning report</title></head><body>\n"
        f"<h1>autobatch: activation checkpointing {html.escape(_plan_words(chosen))}</h1>\n"
        f"<p>{legend}; &#x2715; OOM (drawn at the budget line); the ringed point is the chosen "
        "plan (its predicted peak).</p>\n"
        f"{_memory_svg(data)}\n{_time_svg(data)}\n<ul>{why}</ul>\n"
        '<table id="trials"><tr><th>mode</th><th>micro-batch</th><th>result</th>'
        f"<th>peak memory</th><th>time per sample</th></tr>{rows}</table>\n"
        "</body></html>\n"
    )
