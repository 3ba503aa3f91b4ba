"""PURE: which stored profile answers a plan for a card type or a node, and whether it was
measured there.

A central service holds profiles that many nodes measured. A scheduler asks for a model on a
card type (``card``, e.g. ``"NVIDIA H100 80GB HBM3"``) or on a node (``node``), optionally under
conditions (``{"amp_dtype": "bfloat16"}``). :func:`select_profile` ranks the model's profiles:

1. measured on that node (when ``node`` is given) and card, under the conditions asked;
2. measured on that card on any node, under the conditions asked;
3. measured on that card under other conditions;
4. measured on another card under the conditions asked;
5. any other profile of the model.

The first two are ``measured`` (``estimated`` for an estimate's profile); the rest answer a plan
that is ``predicted`` for the card asked about, and say why. Within a rank the newest wins
(``candidates`` come newest first, as the store lists them). Evaluation profiles never answer a
training plan. Imports neither torch nor pynvml.

Example::

    chosen = select_profile(store.list_profiles(model_fingerprint=fp, limit=200),
                            card="NVIDIA H100 80GB HBM3", node=None, conditions={})
    chosen.match, chosen.reasons     # "predicted", ("measured on NVIDIA A100 ... (node a-1), ...",)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from autobatch.conditions import Conditions
from autobatch.errors import ConfigError
from autobatch.profile import Profile

__all__ = ["CONDITION_NAMES", "Match", "Selection", "condition_mismatches", "select_profile"]

Match = Literal["measured", "estimated", "predicted"]

CONDITION_NAMES = frozenset(field.name for field in dataclasses.fields(Conditions))
"""The conditions a request may name: :class:`autobatch.conditions.Conditions`' fields."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    """The profile chosen to plan from, and how far it answers the question asked."""

    profile_id: str
    """The store's id of the chosen profile."""
    profile: Profile
    """The chosen profile."""
    match: Match
    """``"measured"``: measured on the card (and node) asked about under the conditions asked;
    ``"estimated"``: the same, from an estimate (no real step ran); ``"predicted"``: measured
    elsewhere or under other conditions, so a plan from it is a prediction for the card asked
    about."""
    same_card: bool
    """Whether the profile was measured on the card asked about (True when no card is known)."""
    reasons: tuple[str, ...]
    """Why the match is not ``measured`` (empty when it is), e.g. ``"measured on NVIDIA A100
    80GB PCIe (node a-1), not NVIDIA H100 80GB HBM3"``."""

    def __post_init__(self) -> None:
        if self.match == "predicted" and not self.reasons:
            raise ConfigError("a predicted selection needs the reasons it is not measured")


def condition_mismatches(recorded: Conditions, wanted: Mapping[str, Any]) -> list[str]:
    """The conditions named in ``wanted`` that ``recorded`` does not hold, one phrase each.

    A condition the profile did not record (empty, or not recorded at all) does not match: the
    profile cannot say it was measured under it.

    Args:
        recorded: the profile's conditions.
        wanted: condition name -> value asked for (names from :data:`CONDITION_NAMES`).

    Returns:
        E.g. ``["amp_dtype: recorded 'float16', asked 'bfloat16'"]``; empty when all match.

    Raises:
        ConfigError: a name that is not a condition.
    """
    unknown = sorted(set(wanted) - CONDITION_NAMES)
    if unknown:
        raise ConfigError(
            f"unknown condition(s) {unknown}: name conditions from {sorted(CONDITION_NAMES)}"
        )
    mismatches = []
    for name, value in sorted(wanted.items()):
        have = getattr(recorded, name) if recorded.recorded else None
        if isinstance(have, Mapping):
            have = dict(have)
        if have in (None, "", {}) or (name.startswith("num_") and have == 0):
            mismatches.append(f"{name}: not recorded, asked {value!r}")
        elif have != value:
            mismatches.append(f"{name}: recorded {have!r}, asked {value!r}")
    return mismatches


def select_profile(
    candidates: Sequence[tuple[str, Profile]],
    *,
    card: str | None,
    node: str | None,
    conditions: Mapping[str, Any],
) -> Selection | None:
    """The profile that answers a plan for ``card`` and/or ``node`` (module docstring).

    Args:
        candidates: ``(profile_id, profile)`` pairs of one model, newest first.
        card: the card type asked about (a profile's ``device_name``), or None.
        node: the node asked about (a profile's ``node_name``), or None. Without ``card``, the
            node's card is the one its own profiles of this model were measured on.
        conditions: condition name -> value the plan must hold under (may be empty).

    Returns:
        The selection; None when no candidate is a training profile.

    Raises:
        ConfigError: ``conditions`` names something that is not a condition.
    """
    training = [(pid, p) for pid, p in candidates if p.mode == "train"]
    if not training:
        condition_mismatches(Conditions(), conditions)  # still refuse unknown names
        return None
    if card is None and node is not None:
        card = next((p.device_name for _, p in training if p.node_name == node), None)
    best: tuple[int, str, Profile, list[str]] | None = None
    for profile_id, profile in training:
        differs = condition_mismatches(profile.conditions, conditions)
        on_card = card is None or profile.device_name == card
        on_node = node is None or profile.node_name == node
        if on_card and not differs:
            rank = 1 if on_node else 2
        elif on_card:
            rank = 3
        else:
            rank = 4 if not differs else 5
        if best is None or rank < best[0]:
            best = (rank, profile_id, profile, differs)
        if rank == 1:
            break
    assert best is not None
    rank, profile_id, profile, differs = best
    where = f"{profile.device_name} (node {profile.node_name or 'unrecorded'})"
    reasons: list[str] = []
    if card is not None and profile.device_name != card:
        reasons.append(f"measured on {where}, not {card}")
    elif node is not None and card is None and profile.node_name != node:
        reasons.append(
            f"measured on {where}; node {node} has no profile of this model, so its card is "
            "unknown (name it with card)"
        )
    reasons.extend(f"measured under other conditions: {phrase}" for phrase in differs)
    match: Match = "predicted" if rank > 2 or reasons else "measured"
    if match == "measured" and profile.method == "estimate":
        match = "estimated"
    return Selection(
        profile_id=profile_id,
        profile=profile,
        match=match,
        same_card=card is None or profile.device_name == card,
        reasons=tuple(reasons),
    )
