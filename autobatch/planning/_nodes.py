"""PURE: the answer drawn from several nodes' profiles of one thing, each node counted once, no
node alone deciding.

The profiles that agree on what was measured (one rank of :mod:`autobatch.planning._selection`:
card, budget, conditions) may come from many nodes, some of which publish often, and any of
which may be wrong or lying. :func:`draw_among_nodes` makes the rule:

1. **One voice per node**: its latest profile (by ``created_at``, then id), however many it
   published; profiles without a node name share one voice.
2. **A lower bound is not a maximum**: a search that stopped at its cap (``stop_kind``
   ``"limit"``: the search limit or an effective batch's), or a profile that confirmed a
   prediction with one trial, only says "at least". Where any node measured its maximum, such
   voices are set aside (named in ``lower_bounds``); they never agree with a measured maximum,
   nor override it. With only lower bounds, the answer is drawn among them and says so. A
   lower bound still shows that its size fitted: with fewer than :data:`MIN_VOICES` measured
   maxima, a measured maximum below what at least two other nodes showed fitting (by more than
   :data:`OUTLIER_FACTOR`, lower bounds and maxima alike) is contradicted by them: set aside
   and named an outlier, so one low node cannot undercut two that ran more.
3. **No node alone decides**: the voices are ordered most conservative first (smallest
   recommended micro-batch, then max, then id). With three or more, the answer is the second:
   for any one node set aside, the others still hold a voice at or below the answer and one
   at or above it, so no node (any number of its profiles, any values) moves the answer
   outside what the others measured, up or down; a lone node far below the rest cannot drag
   every plan down either. Nodes whose max micro-batch lies outside the range of all the
   others' (by more than :data:`OUTLIER_FACTOR`) are named ``outliers``. With one or two
   voices, the most conservative answers, and ``rests_on`` names its node: the answer is that
   node's word alone.

The same rule draws among predictions (:mod:`autobatch.planning._cards`): given ``value`` (a
profile's max micro-batch predicted for the card asked about), the voices are ordered, named
outliers and contradicted by that value instead of their own measured sizes.

Example::

    drawn = draw_among_nodes(entries)   # entries: (profile_id, profile, differs)
    drawn.chosen[0], drawn.outliers, drawn.rests_on     # "9a...", ("node-a",), None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from autobatch.profile import Profile

__all__ = ["MIN_VOICES", "OUTLIER_FACTOR", "Drawn", "Entry", "draw_among_nodes", "is_lower_bound"]

Entry = tuple[str, Profile, list[str]]
"""``(profile_id, profile, condition mismatches)``, as the selection ranks them."""

MIN_VOICES = 3
"""Voices (nodes) from which no single node decides: a node and at least two others."""

OUTLIER_FACTOR = 1.25
"""A node is named an outlier when its max micro-batch lies outside the range of all the other
nodes' by more than this factor (below the smallest over 1.25, or above the largest times
1.25). Honest nodes of one card and conditions differ by a few percent (the driver's reserve,
allocator rounding, a search that stopped a bisection step short); a flood of 4096 against a
measured 64 is 64 times. Naming does not change the answer: the rule of three does."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Drawn:
    """The answer drawn among nodes, and whose word it rests on."""

    chosen: Entry
    """The profile that answers."""
    voices: tuple[Entry, ...]
    """One profile per node that the answer was drawn among, most conservative first."""
    outliers: tuple[str, ...] = ()
    """Node names whose max micro-batch lies outside the range all the other voices measured,
    by more than :data:`OUTLIER_FACTOR` (with at least :data:`MIN_VOICES` voices), or whose
    measured maximum at least two other nodes showed fitting past (set aside, not among
    :attr:`voices`); the answer does not rest on them."""
    rests_on: str | None = None
    """With fewer than :data:`MIN_VOICES` voices: the node whose profile answers ('' when it
    recorded none); None when at least two other nodes bound the answer."""
    lower_bounds: tuple[str, ...] = ()
    """Nodes whose profile only bounds the maximum from below (a capped search), set aside
    because others measured it."""
    only_lower_bounds: bool = False
    """True when every voice is a lower bound: the answer is one too."""


def is_lower_bound(profile: Profile) -> bool:
    """Whether ``profile``'s maximum is only a lower bound: its search stopped at a cap, not at
    memory (``stop_kind`` ``"limit"``), or it confirmed a prediction with one trial."""
    return profile.stop_kind == "limit" or profile.confirms_prediction


def draw_among_nodes(
    group: Sequence[Entry], *, value: Callable[[Profile], int] | None = None
) -> Drawn:
    """The answer among ``group`` (module docstring), in any order (it does not depend on it).

    Args:
        group: the entries of one rank.
        value: the micro-batch size each voice stands for (a prediction for another card);
            None for its own max micro-batch, ordered by recommended size first.

    Raises:
        ValueError: ``group`` is empty.
    """
    size = value or _measured_max
    order = _conservative if value is None else (lambda entry: (value(entry[1]), 0, entry[0]))
    if not group:
        raise ValueError("draw_among_nodes needs at least one profile")
    latest: dict[str, Entry] = {}
    for entry in group:
        node = entry[1].node_name
        if node not in latest or _newer(entry, latest[node]):
            latest[node] = entry
    voices = list(latest.values())
    measured = [entry for entry in voices if not is_lower_bound(entry[1])]
    lower = [entry for entry in voices if is_lower_bound(entry[1])]
    few_measured = len(measured) < MIN_VOICES
    contradicted = _contradicted(measured, voices, size) if few_measured else set()
    kept = [entry for entry in measured if entry[0] not in contradicted]
    bounds = lower if kept else []
    pool = sorted(kept or lower or measured, key=order)
    few = len(pool) < MIN_VOICES
    low = {entry[1].node_name for entry in measured if entry[0] in contradicted}
    return Drawn(
        chosen=pool[0] if few else pool[1],
        voices=tuple(pool),
        outliers=tuple(sorted(low | set(() if few else _outliers(pool, size)))),
        rests_on=pool[0][1].node_name if few else None,
        lower_bounds=tuple(sorted(entry[1].node_name for entry in bounds)),
        only_lower_bounds=not kept and bool(lower),
    )


def _contradicted(
    measured: list[Entry], voices: list[Entry], size: Callable[[Profile], int]
) -> set[str]:
    """The ids of the measured maxima below what at least ``MIN_VOICES - 1`` other nodes showed
    fitting (their max micro-batch, a lower bound's included), by more than
    :data:`OUTLIER_FACTOR`."""
    found = set()
    for profile_id, profile, _ in measured:
        ceiling = size(profile) * OUTLIER_FACTOR
        above = [other for other in voices if other[0] != profile_id and size(other[1]) > ceiling]
        if len(above) >= MIN_VOICES - 1:
            found.add(profile_id)
    return found


def _newer(entry: Entry, than: Entry) -> bool:
    return (entry[1].created_at, entry[0]) > (than[1].created_at, than[0])


def _measured_max(profile: Profile) -> int:
    return profile.max_micro_batch_size


def _conservative(entry: Entry) -> tuple[int, int, str]:
    profile_id, profile, _ = entry
    return profile.recommended_micro_batch_size, profile.max_micro_batch_size, profile_id


def _outliers(pool: list[Entry], size: Callable[[Profile], int]) -> tuple[str, ...]:
    """The nodes whose max micro-batch lies outside the others' range by more than
    :data:`OUTLIER_FACTOR`."""
    named = []
    for index, (_, profile, _) in enumerate(pool):
        others = [size(p) for i, (_, p, _) in enumerate(pool) if i != index]
        value = size(profile)
        if value * OUTLIER_FACTOR < min(others) or value > max(others) * OUTLIER_FACTOR:
            named.append(profile.node_name)
    return tuple(sorted(named))
