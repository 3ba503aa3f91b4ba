"""PURE: a plan for a card no profile of the model was measured on, drawn among the nodes of
other cards by what each predicts for the card asked about.

When no node measured the model on the card asked about, other cards speak for it, each through
the catalogue's memory only (a card nobody can check never speaks: the selection leaves it out
before it gets here). Every node that measured the model on another catalogued card is one
voice, whatever its card: its latest profile's max micro-batch predicted for the card asked
about (:func:`predicted_max`: the planner's own prediction, from its measured peaks and memory
line, within the card's catalogue memory, or the budget asked), and the answer is drawn among
those predictions by the rule every measured plan obeys (:mod:`autobatch.planning._nodes`): with
three voices or more the second most conservative, so no single node, on any card, moves the
predicted answer outside what the others predict; with fewer, the most conservative, and the
answer names the node it rests on. Which card a node measured on gives it no more weight than
any other node: one extra node on a card never tips the answer to that card's side past what the
others support. A voice whose profile predicts nothing for that memory (no peaks and no line,
or not even micro-batch 1 fits) is not a voice; when none predicts, the voices are drawn by
their own measured maxima. Imports neither torch nor pynvml.

Example::

    drawn = draw_predicted(entries, target_bytes=48 * 2**30)   # an L40S asked, from others
    drawn.chosen[0], drawn.rests_on                              # "h100-b", None
"""

from __future__ import annotations

from collections.abc import Sequence

from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning._limits import resolve_limit
from autobatch.planning._nodes import Drawn, Entry, draw_among_nodes
from autobatch.profile import Profile

__all__ = ["draw_predicted", "predicted_max"]


def predicted_max(profile: Profile, capacity_bytes: int) -> int | None:
    """The max micro-batch ``profile`` predicts for a card of ``capacity_bytes`` bytes, at its
    own safety margin, as a plan from it would (measured peaks within what ran, its line past
    them); None when it predicts nothing there (no peaks and no line, or micro-batch 1 does not
    fit)."""
    try:
        limit = resolve_limit(
            profile,
            capacity_bytes=capacity_bytes,
            safety_margin=None,
            step_seconds=None,
            source=None,
        )
    except (ConfigError, NoFeasiblePlanError):
        return None
    return limit.max_micro_batch_size


def draw_predicted(group: Sequence[Entry], *, target_bytes: int | None) -> tuple[Drawn, str]:
    """The answer among ``group`` (entries measured on other cards) for a card of
    ``target_bytes`` (module docstring), and the predictions' spread in words (empty when none
    could be made: unknown memory, or no voice predicts)."""
    if target_bytes is None:
        return draw_among_nodes(group), ""
    predicted: dict[str, int] = {}
    for profile_id, profile, _ in group:
        size = predicted_max(profile, target_bytes)
        if size is not None:
            predicted[profile_id] = size
    voices = [entry for entry in group if entry[0] in predicted]
    if not voices:
        return draw_among_nodes(group), ""
    by_profile = {id(entry[1]): predicted[entry[0]] for entry in voices}
    drawn = draw_among_nodes(voices, value=lambda profile: by_profile[id(profile)])
    sizes = [predicted[entry[0]] for entry in drawn.voices]
    spread = (
        f"each node's max micro-batch predicted for {target_bytes / 2**30:.1f} GiB: "
        f"{min(sizes)}..{max(sizes)}"
    )
    return drawn, spread
