"""The benchmarks' results: one tool's search on one (case, capacity) (:class:`ToolResult`), and
the tables that set each tool beside the exhaustive reference and give the medians over them,
as plain text.

Example::

    print(format_table(rows))
    print(format_summary(summarize(rows)))
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from bench._cases import GIB, MIB

__all__ = [
    "TOOLS",
    "ToolResult",
    "format_capacity",
    "format_summary",
    "format_table",
    "median",
    "summarize",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """One tool's search on one (case, capacity)."""

    tool: str
    """``"autobatch"``, ``"lightning"``, ``"accelerate"`` or ``"exhaustive"``."""
    micro_batch_size: int
    """The largest micro-batch the tool reports as fitting (0: none found)."""
    num_trials: int
    """Distinct real sizes tried (warm-up included where the tool runs one)."""
    num_steps: int
    """Real training steps run, including those that ran out of memory."""
    num_ooms: int
    """Steps that ran out of memory."""
    seconds: float
    """Time of the whole search on the device's clock (autobatch: its fake-tensor estimate
    included; the model's construction and the release after it excluded)."""
    sizes: tuple[int, ...] = ()
    """Sizes tried, in order."""
    peak_bytes: tuple[int, ...] = ()
    """Exhaustive only: measured peak of each size from 1 up that fitted."""
    note: str = ""


# -- tables --------------------------------------------------------------------------------------


TOOLS = ("autobatch", "lightning", "accelerate")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _ratio(found: int, reference: int) -> float:
    return found / reference if reference > 0 else float("nan")


def format_capacity(capacity_bytes: int) -> str:
    if capacity_bytes >= GIB:
        return f"{capacity_bytes / GIB:.0f}GiB"
    return f"{capacity_bytes / MIB:.3g}MiB"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (case, capacity, tool); ``rows`` items have ``case``, ``capacity_bytes``,
    ``exhaustive`` (a ToolResult) and one ToolResult per tool in :data:`TOOLS`."""
    header = (
        f"{'model':<16} {'capacity':>9} {'tool':<11} {'found':>6} {'exh.max':>7} {'ratio':>6} "
        f"{'trials':>6} {'steps':>6} {'OOMs':>5} {'seconds':>8}  sizes tried"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        reference: ToolResult = row["exhaustive"]
        for tool in (*TOOLS, "exhaustive"):
            result: ToolResult | None = row.get(tool)
            if result is None:
                continue
            sizes = ",".join(map(str, result.sizes[:14])) + (
                "..." if len(result.sizes) > 14 else ""
            )
            if result.note:
                sizes = f"{sizes}  ({result.note})" if sizes else f"({result.note})"
            lines.append(
                f"{row['case']:<16} {format_capacity(row['capacity_bytes']):>9} {tool:<11} "
                f"{result.micro_batch_size:>6} {reference.micro_batch_size:>7} "
                f"{_ratio(result.micro_batch_size, reference.micro_batch_size):>6.3f} "
                f"{result.num_trials:>6} {result.num_steps:>6} {result.num_ooms:>5} "
                f"{result.seconds:>8.2f}  {sizes}"
            )
    return "\n".join(lines)


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians per tool over the rows: trials, steps, OOMs, found/exhaustive ratio, seconds."""
    summary: dict[str, dict[str, float]] = {}
    for tool in TOOLS:
        results = [(row[tool], row["exhaustive"]) for row in rows if row.get(tool) is not None]
        summary[tool] = {
            "median_trials": median([r.num_trials for r, _ in results]),
            "median_steps": median([r.num_steps for r, _ in results]),
            "median_ooms": median([r.num_ooms for r, _ in results]),
            "median_ratio": median(
                [_ratio(r.micro_batch_size, e.micro_batch_size) for r, e in results]
            ),
            "min_ratio": min(
                (_ratio(r.micro_batch_size, e.micro_batch_size) for r, e in results),
                default=float("nan"),
            ),
            "median_seconds": median([r.seconds for r, _ in results]),
        }
    return summary


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    parts = [
        f"{tool}: trials {s['median_trials']:g}, steps {s['median_steps']:g}, "
        f"OOMs {s['median_ooms']:g}, found/max {s['median_ratio']:.3f} (min {s['min_ratio']:.3f}), "
        f"{s['median_seconds']:.2f} s"
        for tool, s in summary.items()
    ]
    return "medians | " + " | ".join(parts)
