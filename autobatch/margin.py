"""The safety margin: its default and its range, defined once for every way in.

A safety margin is the fraction of a device's capacity a recommended micro-batch keeps free
(fragmentation, workspaces). The probe, the planner, a stored :class:`~autobatch.Profile`, the
request objects, the CLI's ``--safety-margin`` and the service's fields all check it with
:func:`check_safety_margin` and default to :data:`DEFAULT_SAFETY_MARGIN`. Imports neither torch
nor pynvml.

Example::

    check_safety_margin(0.1)     # 0.1
    check_safety_margin(1.5)     # ConfigError: safety_margin 1.5 must be a number in [0, 1) ...
"""

from __future__ import annotations

import math

from autobatch.errors import ConfigError

__all__ = ["DEFAULT_SAFETY_MARGIN", "MAX_SAFETY_MARGIN", "MIN_SAFETY_MARGIN", "check_safety_margin"]

DEFAULT_SAFETY_MARGIN = 0.05
"""Fraction of the capacity kept free unless told otherwise (5%)."""
MIN_SAFETY_MARGIN = 0.0
"""The smallest margin accepted (inclusive): nothing kept free."""
MAX_SAFETY_MARGIN = 1.0
"""The bound no margin reaches (exclusive): a margin of 1 would keep the whole device free."""


def check_safety_margin(value: object) -> float:
    """``value`` as a safety margin: a number in ``[0, 1)``.

    Returns:
        ``value`` as a float.

    Raises:
        ConfigError: a bool, a non-number, NaN or a number outside ``[0, 1)`` (names the value
            and the range, with the default as an example).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or not MIN_SAFETY_MARGIN <= value < MAX_SAFETY_MARGIN
    ):
        raise ConfigError(
            f"safety_margin {value!r} must be a number in [0, 1), e.g. {DEFAULT_SAFETY_MARGIN}: "
            "the fraction of the device's capacity kept free"
        )
    return float(value)
