"""PURE: which stored profiles answer a plan for a card type or a node, which one of them
speaks, and whether it was measured there.

A central service holds profiles that many nodes measured. A scheduler asks for a model on a
card type (``card``, in any of its usual forms: :func:`autobatch.device.card_key`) or on a node
(``node``), optionally under conditions (``{"amp_dtype": "bfloat16"}``) and for a budget (the
memory the job gets, when it is a share of the card). :func:`select_profile` ranks the model's
training profiles (evaluation profiles never answer a training plan):

1. measured on that node (when ``node`` is given) and card, for the budget asked, under the
   conditions asked;
2. measured on that card on any node, for the budget asked, under the conditions asked;
3. measured on that card for the budget asked, under other conditions;
4. for a share of the card: measured on the whole card, under the conditions asked (then 5:
   under other conditions), planned for the share's budget;
6. for a share: measured on the card under a share of another size;
7. measured on another card (a whole card), under the conditions asked (then 8: any other).

The budget a profile was measured for: a profile whose memory budget shows a sharing mode
(time-sliced, fractional, virtualised, memory held by others) or a budget below its card's
memory by more than :data:`~autobatch.device.SHARING_TOLERANCE` was measured under a share
(:func:`measured_share`); it never answers for a whole card. Two shares agree when their budgets
are within that tolerance of each other. A profile without a budget (an estimate, or one written
before autobatch recorded it) counts as measured on the whole card. The budget asked is the
request's (``budget_bytes``, a share when below the card's memory by more than the tolerance);
without one, a node's own profiles say it (a node whose profiles of the card are all shares is a
share), and a card asked alone is a whole card.

The first two ranks are ``measured`` (``estimated`` for an estimate's profile); the rest answer a
plan that is ``predicted`` for the card asked about, and say why. When several profiles share the
best rank (several nodes measured the same thing), the answer is drawn among the nodes, each
counted once, no node alone deciding (:mod:`autobatch.planning._nodes`): one profile per node
(its latest), a capped search only a lower bound, and with three nodes or more the second most
conservative, so that one node cannot move the answer outside what the others measured; the
selection names the outliers, or the node the answer rests on, and the spread of the max
micro-batch sizes. From another card, only a card in autobatch's catalogue speaks
(:func:`autobatch.device.catalogue_memory_bytes`: a name nobody can check never speaks for a real
card), and no card speaks as a card: every node that measured the model on a catalogued other
card is one voice, its latest profile's max micro-batch predicted for the card asked about (its
catalogue memory, or the budget asked), and the rule of three is drawn over those predictions
(:mod:`autobatch.planning._cards`), so no single node, on whichever card, moves a predicted plan
outside what the other nodes' predictions support. Imports neither torch nor pynvml.

Example::

    chosen = select_profile(store.list_profiles(model_fingerprint=fp, limit=200),
                            card="NVIDIA-H100-80GB-HBM3", node=None, conditions={})
    chosen.match, chosen.considered, chosen.max_micro_batch_size_range
    # "measured", ("3f...", "9a...", "c1..."), (32, 40)
    chosen.outliers, chosen.rests_on    # ("node-z",), None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from autobatch.conditions import Conditions
from autobatch.device import SHARING_TOLERANCE, card_key, catalogue_memory_bytes
from autobatch.errors import ConfigError
from autobatch.planning._cards import draw_predicted
from autobatch.planning._nodes import Drawn, Entry, draw_among_nodes
from autobatch.profile import Profile
from autobatch.units import format_bytes

__all__ = [
    "ASKED_SPELLINGS",
    "CONDITION_NAMES",
    "ENVIRONMENT_NAMES",
    "Match",
    "Selection",
    "condition_mismatches",
    "measured_bytes",
    "measured_share",
    "select_profile",
]

Match = Literal["measured", "estimated", "predicted"]

CONDITION_NAMES = frozenset(field.name for field in dataclasses.fields(Conditions))
"""The conditions a request may name: :class:`autobatch.conditions.Conditions`' fields."""

ENVIRONMENT_NAMES = frozenset({"torch_version", "driver_version"})
"""What a request may name beside the conditions: the software a profile was measured with (its
``torch_version`` and ``driver_version``), compared as recorded, e.g. ``"2.13.0+cu128"``."""

_SHOWN_CONDITIONS = ("device_type", "amp_dtype", "optimizer", "activation_checkpointing")
"""The recorded conditions :func:`measured_under` names on every device (as text)."""

_MEASURED_RANKS = 2
_OTHER_CARD_RANKS = (7, 8)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    """The profile chosen to plan from, and how far it answers the question asked."""

    profile_id: str
    """The store's id of the chosen profile."""
    profile: Profile
    """The chosen profile."""
    match: Match
    """``"measured"``: measured on the card (and node) asked about, for the budget and under the
    conditions asked; ``"estimated"``: the same, from an estimate (no real step ran);
    ``"predicted"``: measured elsewhere, for another budget or under other conditions, so a plan
    from it is a prediction for the card asked about."""
    same_card: bool
    """Whether the profile was measured on the card asked about (True when no card is known)."""
    reasons: tuple[str, ...]
    """Why the match is not ``measured`` (empty when it is), e.g. ``"measured on NVIDIA A100
    80GB PCIe (node a-1), not NVIDIA H100 80GB HBM3"``."""
    considered: tuple[str, ...] = ()
    """The ids of the profiles the answer was drawn among, one per node (its latest of the
    chosen one's rank: card, budget, conditions, and node when asked), the chosen one
    included, in id order."""
    max_micro_batch_size_range: tuple[int, int] = (0, 0)
    """The smallest and largest ``max_micro_batch_size`` among :attr:`considered`."""
    basis: str = ""
    """Why this one of them, in words (the rule among nodes and their spread)."""
    outliers: tuple[str, ...] = ()
    """Nodes whose max micro-batch lies outside what all the other nodes measured; the answer
    does not rest on them (:mod:`autobatch.planning._nodes`)."""
    rests_on: str | None = None
    """With fewer than three nodes: the node whose word the answer rests on ('' when its
    profile names none); None when at least two other nodes bound the answer."""
    lower_bounds: tuple[str, ...] = ()
    """Nodes whose search stopped at a cap (a lower bound of the maximum), set aside because
    other nodes measured the maximum."""
    budget_bytes: int | None = None
    """The share's budget to plan the profile for, in bytes, when it was measured on the whole
    card and the plan is for a share of it; None to plan it as measured (or for the budget the
    caller gives)."""
    notes: tuple[str, ...] = ()
    """Lines for the plan's notes about the choice, e.g. an activation checkpointing mode
    ``"auto"`` skipped because its profile could not be planned for the card asked."""

    @property
    def measured_under(self) -> dict[str, str]:
        """What the chosen profile was measured under, as text by name, for an answer to show
        beside the plan: where (``node_name``, ``device_name``), with what (``torch_version``,
        ``driver_version``) and the recorded conditions that move memory (``amp_dtype``,
        ``optimizer``, ``activation_checkpointing``; on CUDA the allocator and cuDNN; the
        data-parallel ``world_size``). Only what the profile recorded: an empty value is left
        out. The asking job's, where they differ, are in :attr:`reasons`.

        Example: ``{"node_name": "a-1", "device_name": "NVIDIA H100 80GB HBM3",
        "torch_version": "2.11.0", "driver_version": "550.54.15", "amp_dtype": "bfloat16"}``.
        """
        return _measured_under(self.profile)

    def __post_init__(self) -> None:
        if self.match == "predicted" and not self.reasons:
            raise ConfigError("a predicted selection needs the reasons it is not measured")
        if self.considered and self.profile_id not in self.considered:
            raise ConfigError(f"the chosen profile {self.profile_id!r} must be among considered")


def measured_bytes(profile: Profile) -> int:
    """The memory budget ``profile`` was measured under, in bytes: its budget's, else the
    capacity it recorded."""
    return profile.capacity_bytes if profile.budget is None else profile.budget.budget_bytes


def measured_share(profile: Profile) -> bool:
    """Whether ``profile`` was measured under a share of its card (module docstring): its GPU
    memory budget shows a sharing mode, or is below the card's memory by more than
    :data:`~autobatch.device.SHARING_TOLERANCE`. False without a budget, or on a host."""
    budget = profile.budget
    if budget is None or not budget.is_gpu:
        return False
    below = budget.budget_bytes < profile.total_memory_bytes * (1 - SHARING_TOLERANCE)
    return budget.sharing_mode != "none" or below


ASKED_SPELLINGS: dict[str, dict[str, str]] = {
    "amp_dtype": {
        "bf16": "bfloat16",
        "torch.bfloat16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "torch.float16": "float16",
        "torch.half": "float16",
    }
}
"""Other spellings of a condition's recorded value that a plan may be asked with (the CLI's
``--amp bf16``, torch's ``torch.bfloat16``), by condition name, lower case."""


def condition_mismatches(
    recorded: Conditions,
    wanted: Mapping[str, Any],
    *,
    environment: Mapping[str, str] | None = None,
) -> list[str]:
    """The conditions named in ``wanted`` that ``recorded`` does not hold, one phrase each.

    A condition the profile did not record (empty, or not recorded at all) does not match: the
    profile cannot say it was measured under it.

    Args:
        recorded: the profile's conditions.
        wanted: condition name -> value asked for (names from :data:`CONDITION_NAMES` and
            :data:`ENVIRONMENT_NAMES`).
        environment: the profile's software by :data:`ENVIRONMENT_NAMES` name
            (``{"torch_version": "2.11.0"}``); None when unknown.

    Returns:
        E.g. ``["amp_dtype: recorded 'float16', asked 'bfloat16'"]``; empty when all match.

    Raises:
        ConfigError: a name that is not a condition.
    """
    unknown = sorted(set(wanted) - CONDITION_NAMES - ENVIRONMENT_NAMES)
    if unknown:
        names = ", ".join(f"'{name}'" for name in sorted(CONDITION_NAMES | ENVIRONMENT_NAMES))
        raise ConfigError(
            f"unknown condition(s) {', '.join(repr(name) for name in unknown)}: name conditions "
            f"from {names}"
        )
    mismatches = []
    for name, asked in sorted(wanted.items()):
        value = ASKED_SPELLINGS.get(name, {}).get(str(asked).strip().lower(), asked)
        if name in ENVIRONMENT_NAMES:
            have: Any = (environment or {}).get(name)
        else:
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
    budget_bytes: int | None = None,
    mig_profile: str | None = None,
) -> Selection | None:
    """The profile that answers a plan for ``card`` and/or ``node`` (module docstring).

    Args:
        candidates: ``(profile_id, profile)`` pairs of one model, in any order (the choice does
            not depend on it).
        card: the card type asked about, in any form :func:`autobatch.device.card_key` reads,
            or None. Without it, a node's card is the one its own profiles of this model were
            measured on (the newest first in ``candidates``).
        node: the node asked about (a profile's ``node_name``), or None.
        conditions: condition name -> value the plan must hold under (may be empty).
        budget_bytes: the memory the job gets on the card, in bytes, when the caller knows it
            (a device given); None for what the node's profiles say, or the whole card.
        mig_profile: the MIG slice of ``card`` the job gets (e.g. ``"1g.10gb"``), or None.

    Returns:
        The selection; None when no candidate may answer: none is a training profile, or each
        was measured under a share of a card and the plan is for a whole card.

    Raises:
        ConfigError: ``conditions`` names something that is not a condition; ``card`` names no
            card, or a MIG profile other than ``mig_profile``.
    """
    training = [(pid, p) for pid, p in candidates if p.mode == "train"]
    condition_mismatches(Conditions(), conditions)  # refuse unknown names, whatever is stored
    if not training:
        return None
    key = None if card is None else card_key(card, mig_profile)
    if key is None and node is not None:
        key = next((_key(p) for _, p in training if p.node_name == node), None)
    on_card = [p for _, p in training if key is None or _key(p) == key]
    share = _share_bytes(on_card, node, budget_bytes)
    ranked: dict[int, list[Entry]] = {}
    for profile_id, profile in training:
        differs = condition_mismatches(
            profile.conditions, conditions, environment=_environment(profile)
        )
        rank = _rank(profile, key=key, node=node, share=share, differs=bool(differs))
        if rank is not None:
            ranked.setdefault(rank, []).append((profile_id, profile, differs))
    if not ranked:
        return None
    rank = min(ranked)
    group = ranked[rank]
    spread = ""
    if rank in _OTHER_CARD_RANKS:
        target = share if share is not None else budget_bytes
        if target is None and key is not None:
            target = catalogue_memory_bytes(key)
        drawn, spread = draw_predicted(group, target_bytes=target)
    else:
        drawn = draw_among_nodes(group)
    profile_id, profile, differs = drawn.chosen
    reasons = _reasons(profile, card=card, key=key, node=node, share=share, differs=differs)
    match: Match = "predicted" if rank > _MEASURED_RANKS or reasons else "measured"
    if match == "measured" and profile.method == "estimate":
        match = "estimated"
    maxima = [p.max_micro_batch_size for _, p, _ in drawn.voices]
    return Selection(
        profile_id=profile_id,
        profile=profile,
        match=match,
        same_card=key is None or _key(profile) == key,
        reasons=tuple(reasons),
        considered=tuple(sorted(pid for pid, _, _ in drawn.voices)),
        max_micro_batch_size_range=(min(maxima), max(maxima)),
        basis=_basis(drawn, min(maxima), max(maxima), spread),
        budget_bytes=share if share is not None and not _measured_for(profile, share) else None,
        outliers=drawn.outliers,
        rests_on=drawn.rests_on,
        lower_bounds=drawn.lower_bounds,
    )


def _measured_under(profile: Profile) -> dict[str, str]:
    """:attr:`Selection.measured_under` of ``profile``."""
    found = {"node_name": profile.node_name, "device_name": profile.device_name}
    found |= _environment(profile)
    conditions = profile.conditions
    if conditions.recorded:
        found |= {name: str(getattr(conditions, name)) for name in _SHOWN_CONDITIONS}
        if conditions.applies("allocator_settings"):
            found["allocator_settings"] = conditions.allocator_settings or "torch defaults"
            found["allocator_backend"] = conditions.allocator_backend
            found["cudnn"] = ", ".join(f"{k}={v}" for k, v in sorted(conditions.cudnn.items()))
        if conditions.world_size:
            found["world_size"] = str(conditions.world_size)
    return {name: value for name, value in found.items() if value}


def _environment(profile: Profile) -> dict[str, str]:
    """The profile's software by :data:`ENVIRONMENT_NAMES` name, those it recorded."""
    found = {"torch_version": profile.torch_version, "driver_version": profile.driver_version}
    return {name: value for name, value in found.items() if value}


def _key(profile: Profile) -> str:
    """The card key of the card ``profile`` was measured on; its raw name when it names none."""
    try:
        return card_key(profile.device_name)
    except ConfigError:
        return profile.device_name


def _share_bytes(on_card: list[Profile], node: str | None, budget_bytes: int | None) -> int | None:
    """The share's budget the plan is for, in bytes; None for a whole card (module docstring)."""
    if budget_bytes is not None:
        card = max((p.total_memory_bytes for p in on_card), default=0)
        return budget_bytes if budget_bytes < card * (1 - SHARING_TOLERANCE) else None
    mine = [p for p in on_card if node is not None and p.node_name == node]
    if mine and all(measured_share(p) for p in mine):
        return min(measured_bytes(p) for p in mine)
    return None


def _rank(
    profile: Profile, *, key: str | None, node: str | None, share: int | None, differs: bool
) -> int | None:
    """The profile's rank (module docstring); None when it may not answer at all."""
    is_share = measured_share(profile)
    if key is not None and _key(profile) != key:
        if is_share or catalogue_memory_bytes(profile.device_name) is None:
            return None  # a share, or a card nobody can check, never speaks for another card
        return 8 if differs else 7
    if share is None and is_share:
        return None  # a share never speaks for a whole card
    if share is None or _measured_for(profile, share):
        if differs:
            return 3
        return 1 if node is None or profile.node_name == node else 2
    if not is_share:
        return 5 if differs else 4
    return 6


def _measured_for(profile: Profile, share_bytes: int) -> bool:
    """Whether ``profile`` was measured under a share that agrees with ``share_bytes``."""
    return measured_share(profile) and _agree(measured_bytes(profile), share_bytes)


def _agree(first_bytes: int, second_bytes: int) -> bool:
    """Two shares' budgets agree: within SHARING_TOLERANCE of the larger."""
    return abs(first_bytes - second_bytes) <= SHARING_TOLERANCE * max(first_bytes, second_bytes)


def _reasons(
    profile: Profile,
    *,
    card: str | None,
    key: str | None,
    node: str | None,
    share: int | None,
    differs: list[str],
) -> list[str]:
    """Why a plan from ``profile`` is not measured for what was asked (empty when it is)."""
    where = f"{profile.device_name} (node {profile.node_name or 'unrecorded'})"
    reasons: list[str] = []
    if key is not None and _key(profile) != key:
        reasons.append(f"measured on {where}, not {card or key}")
    elif node is not None and card is None and key is None:
        reasons.append(
            f"measured on {where}; node {node} has no profile of this model, so its card is "
            "unknown (name it with card)"
        )
    measured = measured_bytes(profile)
    if share is not None and not _measured_for(profile, share):
        what = "a share" if measured_share(profile) else "the whole card"
        reasons.append(
            f"measured on {what} ({format_bytes(measured)}), planned for a share of "
            f"{format_bytes(share)}"
        )
    reasons.extend(f"measured under other conditions: {phrase}" for phrase in differs)
    return reasons


def _basis(drawn: Drawn, smallest: int, largest: int, spread: str) -> str:
    """The rule that chose among the nodes, in words (``spread``: their predictions', for a
    card none of them measured on, or empty)."""
    num = len(drawn.voices)
    bound = " (each a lower bound: its search stopped at a cap)" if drawn.only_lower_bounds else ""
    if drawn.rests_on is not None:
        who = drawn.rests_on or "unrecorded"
        if num == 1:
            said = "the only node that measured it (no other agrees on card, budget and conditions)"
        else:
            said = f"the more conservative of 2 nodes (max micro-batch {smallest}..{largest})"
        text = f"rests on node {who} alone: {said}{bound}"
    else:
        order = "by prediction" if spread else "smallest recommended, then max micro-batch"
        text = (
            f"drawn among {num} nodes, one profile each{bound}: the second most conservative "
            f"({order}), so no one node moves it outside "
            f"what the others measured (max micro-batch {smallest}..{largest})"
        )
    if spread:
        text += f"; {spread}"
    if drawn.outliers:
        text += f"; outliers, outside what every other node measured: {', '.join(drawn.outliers)}"
    if drawn.lower_bounds:
        text += (
            f"; set aside as lower bounds (search stopped at a cap, not at memory): "
            f"{', '.join(drawn.lower_bounds)}"
        )
    return text
