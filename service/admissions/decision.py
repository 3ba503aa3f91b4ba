"""PURE: a scheduler's admission decision for one job, from each candidate card's plans over
GPU counts (:func:`autobatch.planning.plan_table`'s rows). No store, no HTTP: numbers in, a
:class:`Decision` out.

The rules (docs/deploy.md, "Admission"):

- A job that asks for ``world_size`` GPUs is **accepted** on the first card (in the job's order)
  whose plan at that count reaches its effective batch.
- A job that asks to be **sized** gets, on the first card that reaches its batch at any GPU count
  the site allows (``allowed_world_sizes``, at most ``max_world_size``), the fewest GPUs whose
  plan reaches it; where every such plan carries predicted step times, the fewest GPUs whose
  predicted seconds per effective batch are within ``speed_tolerance`` of the fastest (more GPUs
  that add no speed are not held).
- Otherwise the batch is **unreachable**: the answer names the nearest reachable effective
  batches at the asked count and the GPU counts that reach the asked batch.
- A job none of whose cards has a profile of its model is **unplanned**: admitted unchanged.

Example::

    decision = decide(
        [CardOptions(card="NVIDIA H100 80GB HBM3", profile_id="p1", rows=rows)],
        world_size=16,
        policy=AdmissionPolicy(size=True, allowed_world_sizes=(1, 2, 4, 8, 16)),
    )
    decision.outcome, decision.world_size, decision.reasons
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from autobatch.planning import Match, Plan, WorldSizeOption
from autobatch.units import counted

__all__ = [
    "DEFAULT_ALLOWED_WORLD_SIZES",
    "DEFAULT_SPEED_TOLERANCE",
    "AdmissionPolicy",
    "CardOptions",
    "Decision",
    "Outcome",
    "counts_to_plan",
    "decide",
]

Outcome = Literal["accepted", "sized", "unreachable", "unplanned"]
"""What the scheduler does: admit as asked with the plan; admit with the GPU count set to
``world_size``; refuse (the batch cannot be reached); admit unchanged (nothing to plan from)."""

DEFAULT_ALLOWED_WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""The GPU counts a site allows when its policy names none: powers of two up to 64."""

DEFAULT_SPEED_TOLERANCE = 0.05
"""More GPUs must be predicted more than 5% faster per effective batch to be chosen."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionPolicy:
    """The site's rules for sizing a job."""

    size: bool = False
    """Choose the job's GPU count (the job asked to be sized) instead of planning the asked one."""
    allowed_world_sizes: tuple[int, ...] = DEFAULT_ALLOWED_WORLD_SIZES
    """GPU counts a job may be given (and the counts named to a refused job), ascending."""
    max_world_size: int | None = None
    """No job is sized past this many GPUs; None for no ceiling but ``allowed_world_sizes``."""
    speed_tolerance: float = DEFAULT_SPEED_TOLERANCE
    """A fraction: with step times, counts within it of the fastest count as as fast."""
    largest_effective_batch_size: int | None = None
    """The largest effective batch a job may ask (the request's own bound): a nearest reachable
    batch beyond it is not named, since asking it would be refused; None for no bound."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CardOptions:
    """One candidate card: its profile's plans at each GPU count considered, or why none."""

    card: str | None
    """The card type (a profile's device_name); None for the model's profile drawn among the
    nodes on the card the most nodes measured."""
    profile_id: str | None
    rows: tuple[WorldSizeOption, ...] = ()
    """One row per GPU count considered (:func:`autobatch.planning.plan_table`'s)."""
    missing: str = ""
    """Why this card has no plans (no profile of the model for it); empty when ``rows`` hold."""
    match: Match | None = None
    """How the profile matches the card (:class:`autobatch.planning.Selection`'s ``match``):
    ``predicted`` when measured on another card or under other conditions; None when no card
    was asked (the plans' own source speaks)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The decision and its reasons, in words a user reads at submission."""

    outcome: Outcome
    card: str | None
    """The card chosen; None when none is (unreachable, unplanned)."""
    world_size: int | None
    """The GPU count to run on (data-parallel ranks); None when refused or unplanned."""
    plan: Plan | None
    profile_id: str | None
    reasons: tuple[str, ...]
    nearest_effective_batch_sizes: tuple[int, ...] = ()
    """For an unreachable batch: the nearest reachable at the asked GPU count, below and above."""
    reaching_world_sizes: tuple[int, ...] = ()
    """The allowed GPU counts whose plan reaches the asked effective batch (on the first card
    that has any), ascending."""


def counts_to_plan(world_size: int | None, policy: AdmissionPolicy) -> tuple[int, ...]:
    """The GPU counts whose plans the decision may read: the asked one and the allowed ones
    (within the ceiling), ascending. A job that is not sized needs only the asked count when it
    is accepted there; the allowed ones then only name the counts that reach an unreachable
    batch (``reaching_world_sizes``)."""
    counts = {count for count in policy.allowed_world_sizes if _within(count, policy)}
    if world_size is not None:
        counts.add(world_size)
    return tuple(sorted(counts))


def decide(
    cards: Sequence[CardOptions], *, world_size: int | None, policy: AdmissionPolicy
) -> Decision:
    """The decision for a job asking ``world_size`` GPUs (None: only with ``policy.size``).

    Raises:
        ValueError: neither a ``world_size`` nor ``policy.size``; no cards.
    """
    if world_size is None and not policy.size:
        raise ValueError("give world_size (the GPUs the job asks for) or size the job")
    if not cards:
        raise ValueError("give at least one candidate card")
    planned = [options for options in cards if not options.missing]
    skipped = tuple(f"{_card_words(c.card)}: {c.missing}" for c in cards if c.missing)
    if not planned:
        return Decision(
            outcome="unplanned",
            card=None,
            world_size=None,
            plan=None,
            profile_id=None,
            reasons=skipped,
        )
    chosen = None
    for options in planned:
        chosen = _sized(options, policy) if policy.size else _at(options, world_size)
        if chosen is not None:
            break
    else:
        chosen = _unreachable(planned, world_size, policy)
    return dataclasses.replace(chosen, reasons=(*chosen.reasons, *skipped))


def _within(count: int, policy: AdmissionPolicy) -> bool:
    return policy.max_world_size is None or count <= policy.max_world_size


def _reaching(options: CardOptions, policy: AdmissionPolicy) -> list[WorldSizeOption]:
    allowed = set(policy.allowed_world_sizes)
    return [
        row
        for row in options.rows
        if row.plan is not None and row.world_size in allowed and _within(row.world_size, policy)
    ]


def _at(options: CardOptions, world_size: int | None) -> Decision | None:
    row = next((row for row in options.rows if row.world_size == world_size), None)
    if row is None or row.plan is None:
        return None
    return Decision(
        outcome="accepted",
        card=options.card,
        world_size=row.world_size,
        plan=row.plan,
        profile_id=options.profile_id,
        reasons=(f"accepted: {_plan_words(row.plan, options)} on {_card_words(options.card)}",),
    )


def _sized(options: CardOptions, policy: AdmissionPolicy) -> Decision | None:
    reaching = _reaching(options, policy)
    if not reaching:
        return None
    times = [row.plan.predicted_seconds_per_effective_batch for row in reaching if row.plan]
    counts = ", ".join(str(row.world_size) for row in reaching)
    if all(seconds is not None for seconds in times):
        fastest = min(seconds for seconds in times if seconds is not None)
        bound = fastest * (1 + policy.speed_tolerance)
        row = next(
            row
            for row in reaching
            if row.plan and (row.plan.predicted_seconds_per_effective_batch or 0.0) <= bound
        )
        seconds = row.plan.predicted_seconds_per_effective_batch if row.plan else None
        why = (
            f"the fewest GPUs predicted within {policy.speed_tolerance:.0%} of the fastest "
            f"({seconds:.3g} s per effective batch against {fastest:.3g} s) among the counts "
            f"that reach it ({counts})"
        )
    else:
        row = reaching[0]
        why = f"the fewest GPUs whose plan reaches it (of {counts}; no step times to compare)"
    assert row.plan is not None
    return Decision(
        outcome="sized",
        card=options.card,
        world_size=row.world_size,
        plan=row.plan,
        profile_id=options.profile_id,
        reasons=(
            f"sized to {counted(row.world_size, 'GPU')} of {_card_words(options.card)}: {why}; "
            f"{_plan_words(row.plan, options)}",
        ),
        reaching_world_sizes=tuple(r.world_size for r in reaching),
    )


def _unreachable(
    planned: Sequence[CardOptions], world_size: int | None, policy: AdmissionPolicy
) -> Decision:
    first = planned[0]
    reasons = []
    nearest: tuple[int, ...] = ()
    for options in planned:
        asked = [row for row in options.rows if row.world_size == world_size]
        for row in asked:
            reasons.append(
                f"effective batch cannot be reached on {counted(row.world_size, 'GPU')} of "
                f"{_card_words(options.card)}: {row.reason}"
            )
            if not nearest:
                nearest = _nearest(row, policy)
    if not asked and policy.size:
        reasons.append(
            f"no allowed GPU count ({', '.join(map(str, counts_to_plan(None, policy)))}) "
            f"reaches the effective batch on {_card_words(first.card)}"
        )
    reaching = next((found for c in planned if (found := _reaching(c, policy))), [])
    counts = tuple(row.world_size for row in reaching)
    if nearest:
        reasons.append(
            "nearest reachable effective batch sizes: " + ", ".join(str(n) for n in nearest)
        )
    if counts:
        reasons.append("GPU counts that reach it: " + ", ".join(str(c) for c in counts))
    return Decision(
        outcome="unreachable",
        card=None,
        world_size=None,
        plan=None,
        profile_id=None,
        reasons=tuple(reasons),
        nearest_effective_batch_sizes=nearest,
        reaching_world_sizes=counts,
    )


def _nearest(row: WorldSizeOption, policy: AdmissionPolicy) -> tuple[int, ...]:
    """The planner's nearest reachable effective batches for ``row``, within what a job may ask
    (``policy.largest_effective_batch_size``)."""
    largest = policy.largest_effective_batch_size
    for remedy in row.remedies:
        if remedy.parameter == "effective_batch_size":
            values = (int(str(value)) for value in remedy.values)
            return tuple(v for v in values if largest is None or v <= largest)
    return ()


def _plan_words(plan: Plan, options: CardOptions) -> str:
    source = plan.source if options.match is None or plan.source == "predicted" else options.match
    return (
        f"effective batch {plan.effective_batch_size} = micro-batch {plan.micro_batch_size} x "
        f"{counted(plan.gradient_accumulation_steps, 'accumulation step')} x "
        f"{counted(plan.world_size, 'GPU')} "
        f"({source})"
    )


def _card_words(card: str | None) -> str:
    return card if card is not None else "the card the most nodes measured the model on"
