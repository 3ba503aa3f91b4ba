"""The memory limit NVIDIA's Multi-Process Service (MPS) sets on a client:
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, as a budget reading.

PURE: an environment mapping in, a :class:`~autobatch.device.BudgetReading` (source
``mps_limit``) out; no torch, no pynvml. An MPS client may allocate no more device memory than
the limit, while NVML and often the CUDA runtime still report the whole card, so without this
reading a plan may peak far above what the client can allocate.

The variable's grammar, as NVIDIA's MPS documentation gives it (and NVIDIA's device plugin sets
it under its ``mps`` sharing strategy):

- a comma-separated list of ``<device>=<limit>``: ``0=4G,1=8G``; ``<device>`` is a CUDA device
  ordinal as the client sees it (after ``CUDA_VISIBLE_DEVICES``) or a GPU UUID
  (``GPU-8932f937-...``, or its first characters, as ``CUDA_VISIBLE_DEVICES`` accepts);
- or one ``<limit>`` alone, for every device: ``4606M``;
- ``<limit>`` is a whole number with a unit ``M`` or ``G`` (binary: MiB, GiB), either case, an
  optional trailing ``B``: ``4606M``, ``4606MB``, ``4G``.

A device the list does not name has no MPS limit (no reading).

Per-client limits set by the control daemon (``set_default_device_pinned_mem_limit``) reach the
client through the same variable only when the launcher exports it; NVML (nvidia-ml-py 13.615)
has no query for an MPS client's pinned memory limit, so none is read from it.

Example::

    reading = mps_limit_reading({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4606M"}, cuda_index=0)
    reading.available_bytes, reading.source    # (4829741056, 'mps_limit')
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from autobatch.device._budget import BudgetReading
from autobatch.errors import ConfigError

__all__ = ["MPS_LIMIT_VARIABLE", "mps_limit_reading", "parse_mps_limits"]

MPS_LIMIT_VARIABLE = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
"""The MPS client's pinned device memory limit variable."""

_LIMIT = re.compile(r"^([0-9]+)([mMgG])[bB]?$")
_UNITS = {"m": 2**20, "g": 2**30}
_DEVICE = re.compile(r"^(?:[0-9]+|GPU-[0-9A-Fa-f-]+|MIG-[0-9A-Za-z/-]+)$")
_FORMS = (
    "write '<limit>' for every device or '<device>=<limit>[,<device>=<limit>...]', where "
    "<device> is a CUDA ordinal or a GPU UUID and <limit> a whole number with the unit M or G "
    "(binary, optional B), e.g. '0=4606M', '4606MB' or '0=4G,1=8G', as NVIDIA's MPS reads it"
)
_ALL_DEVICES = "*"


def _bytes(name: str, text: str, limit: str) -> int:
    match = _LIMIT.match(limit.strip())
    if match is None or int(match.group(1)) == 0:
        raise ConfigError(f"{name}={text!r} is not an MPS memory limit: {_FORMS}")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_mps_limits(text: str, *, name: str = MPS_LIMIT_VARIABLE) -> dict[str, int]:
    """The limits of ``text`` by device: ``{"0": bytes, "GPU-...": bytes}``, or
    ``{"*": bytes}`` for one limit on every device.

    Args:
        text: the variable's value (module docstring); blank is no limit (``{}``).
        name: the variable's name, for the error.

    Raises:
        ConfigError: anything else, a limit of 0 or a device named twice (names the variable,
            its value and the forms accepted).
    """
    if not text.strip():
        return {}
    if "=" not in text:
        return {_ALL_DEVICES: _bytes(name, text, text)}
    limits: dict[str, int] = {}
    for entry in text.split(","):
        device, equals, limit = entry.partition("=")
        device = device.strip()
        if not equals or _DEVICE.match(device) is None or device in limits:
            raise ConfigError(f"{name}={text!r} is not an MPS memory limit: {_FORMS}")
        limits[device] = _bytes(name, text, limit)
    return limits


def mps_limit_reading(
    environ: Mapping[str, str], *, cuda_index: int, uuid: str | None = None
) -> BudgetReading | None:
    """The MPS limit on CUDA device ``cuda_index`` (NVML UUID ``uuid`` when known) from
    ``environ``'s ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; None when unset, blank, or naming
    other devices only.

    A UUID entry matches when ``uuid`` starts with it (case-insensitive), as
    ``CUDA_VISIBLE_DEVICES`` matches an abbreviated UUID.

    Raises:
        ConfigError: a value that is not an MPS memory limit (see :func:`parse_mps_limits`).
    """
    text = environ.get(MPS_LIMIT_VARIABLE, "")
    limits = parse_mps_limits(text)
    limit = limits.get(_ALL_DEVICES, limits.get(str(cuda_index)))
    if limit is None and uuid is not None:
        limit = next(
            (
                b
                for d, b in limits.items()
                if not d.isdigit() and uuid.lower().startswith(d.lower())
            ),
            None,
        )
    if limit is None:
        return None
    return BudgetReading(
        source="mps_limit",
        total_bytes=limit,
        available_bytes=limit,
        detail=f"{MPS_LIMIT_VARIABLE}={text.strip()!r} (an MPS client's pinned device memory)",
    )
