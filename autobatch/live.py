"""``autobatch.plan`` in a training process: the planner's plan, then checked against this
process's conditions.

:func:`plan` is :func:`autobatch.planning.plan` (same arguments, same Plan), and then, when this
process has loaded torch (it runs steps; a scheduler that plans without torch is not checked
and does not load it):

- for a plan from a Profile, for the card it measured (no ``capacity_bytes``): the profile's
  conditions that can be read without the model (allocator settings in effect, cuDNN flags) are
  compared with this process's (:func:`autobatch.conditions.condition_changes`);
- without ``world_size``: the plan's single rank is compared with the data-parallel size the
  launcher (``WORLD_SIZE``) or the default process group says.

Each difference is a :class:`~autobatch.errors.ConditionsWarning` and a note of the plan,
naming the condition, both values and the fix. The service and the CLI plan through
:mod:`autobatch.planning`, for jobs in other processes, and are not checked.

Example::

    plan = autobatch.plan(profile, effective_batch_size=256)  # warns if cudnn.benchmark differs
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable
from typing import ParamSpec

from autobatch.conditions import Conditions, condition_changes
from autobatch.errors import ConditionsWarning
from autobatch.planning import Plan
from autobatch.planning import plan as _plan

__all__ = ["plan"]

P = ParamSpec("P")


def _checked_here(function: Callable[P, Plan]) -> Callable[P, Plan]:
    """``function``, whose Plan is then checked against this process (see the module)."""

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> Plan:
        result = function(*args, **kwargs)
        if "torch" not in sys.modules:
            return result
        changes = _changes_here(
            result,
            for_this_card=kwargs.get("capacity_bytes") is None,
            world_size_given="world_size" in kwargs,
        )
        if not changes:
            return result
        for change in changes:
            warnings.warn(
                f"the plan does not hold in this process: {change}", ConditionsWarning, stacklevel=2
            )
        return dataclasses.replace(result, notes=(*result.notes, *changes))

    checked.__doc__ = (function.__doc__ or "") + _CHECKED_HERE
    return checked


_CHECKED_HERE = """
    As ``autobatch.plan``, in a process that has loaded torch, the plan is then checked against
    this process (:mod:`autobatch.live`): a profile's allocator settings and cuDNN flags (for the
    card it measured, no ``capacity_bytes``) and, without ``world_size``, the launcher's or the
    process group's ranks; each difference is a ``ConditionsWarning`` and a note.
"""


def _changes_here(result: Plan, *, for_this_card: bool, world_size_given: bool) -> list[str]:
    # torch-bound: read only in a process that has loaded torch; importing this module stays
    # torch-free
    from autobatch.probing import live_data_parallel, process_conditions

    live = process_conditions(data_parallel=live_data_parallel())
    recorded = result.conditions if for_this_card else Conditions()
    changes = condition_changes(
        recorded, live, world_size=None if world_size_given else result.world_size
    )
    return [change.describe() for change in changes]


plan = _checked_here(_plan)
