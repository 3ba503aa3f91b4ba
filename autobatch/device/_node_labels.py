"""The GPU memory a job gets on a Kubernetes node, from GPU feature discovery (GFD) labels.

Pure: labels (and, when the reader has them, its own NVML readings) in, bytes out; no torch, no
pynvml. :func:`autobatch.device.budget_from_labels` turns the result into a memory budget.

- ``nvidia.com/gpu.memory`` is documented in MiB, but some GFD versions wrote bytes (a 40 GB card
  read ``42505273344``). No real MiB value exceeds 2**31 (2 PiB), so a larger value can only be
  bytes: it is read as bytes, with a warning in the answer.
- When the reader's own NVML (the service's sidecar) sees the card the labels describe (the same
  product by :func:`autobatch.device.card_key`: GFD writes NVML's spaces as dashes) and its
  total memory differs from the label by more than :data:`NVML_TOLERANCE`, NVML wins, with a
  warning.
- MIG, mixed strategy (``nvidia.com/mig.strategy=mixed``): each slice profile has its own labels,
  ``nvidia.com/mig-<profile>.memory`` (MiB), ``.count`` and friends, while ``nvidia.com/gpu.*``
  describe the parent card. A job on a slice gets the slice's memory, so when the node shows MIG
  slices the caller names the profile (``mig_profile="1g.5gb"``) and the plan is for that slice.
  Under the single strategy GFD's ``nvidia.com/gpu.*`` labels already describe the slice.
- Shared cards (the device plugin's time-slicing or MPS sharing): each physical card (or MIG
  slice) is handed out as ``nvidia.com/gpu.replicas`` (``nvidia.com/mig-<profile>.replicas``)
  replicas, with no memory isolation between them, and the product label ends in ``-SHARED``
  (unless the plugin renames the resource instead). A job on one replica shares the card with
  up to ``replicas - 1`` others, so it is planned for ``1 / replicas`` of it (``replicas``),
  never the whole card; a ``-SHARED`` product with no readable replicas label is refused, naming
  ``gpu_fraction`` as the way to say the share.

A label that cannot be read is a :class:`LabelError` (a :class:`~autobatch.errors.ConfigError`)
whose ``field`` names the input at fault: ``node_labels.<label>``, ``mig_profile`` or
``gpu_fraction``, which each surface names in its own terms (the service as the request's
field path, ``body.device.mig_profile``).

Example::

    device = read_node_labels({"nvidia.com/gpu.memory": "81920"}, mig_profile=None, gpus=[])
    device.capacity_bytes       # 85899345920
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from autobatch.device._card_names import same_card
from autobatch.device._types import GpuInfo
from autobatch.errors import ConfigError
from autobatch.units import format_bytes

__all__ = [
    "GPU_MEMORY_LABEL",
    "GPU_PRODUCT_LABEL",
    "GPU_REPLICAS_LABEL",
    "MAX_MIB",
    "MIG_STRATEGY_LABEL",
    "NVML_TOLERANCE",
    "LabelError",
    "NodeDevice",
    "read_node_labels",
]

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_REPLICAS_LABEL = "nvidia.com/gpu.replicas"
SHARING_STRATEGY_LABEL = "nvidia.com/gpu.sharing-strategy"
SHARED_SUFFIX = "-SHARED"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
_MIG_MEMORY = re.compile(r"^nvidia\.com/mig-(?P<profile>[^/]+)\.memory$")

MAX_MIB = 2**31
"""No real MiB value reaches this (2 PiB); a label value above it can only be bytes."""
_MAX_BYTES = 2**50
"""A value read as bytes above this (1 PiB) is nonsense either way and is refused."""
NVML_TOLERANCE = 0.05
"""Labels and NVML may differ this much (fraction of NVML's total) before NVML wins."""


class LabelError(ConfigError):
    """A label is missing or unreadable, or the labels leave the job's share unknown.

    Attributes:
        field: the input at fault, relative to the device named: ``"node_labels.<label>"``,
            ``"mig_profile"`` or ``"gpu_fraction"``.
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_label_error, (self.message, self.field)


def _rebuild_label_error(message: str, field: str) -> LabelError:
    return LabelError(message, field=field)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeDevice:
    """The device a job gets on a labelled node."""

    capacity_bytes: int
    """Memory of the card (or MIG slice), in bytes."""
    name: str | None
    """GFD's product name (``-MIG-<profile>`` appended for a slice); None without the label."""
    warnings: tuple[str, ...] = ()
    """What was corrected, and why (bytes for MiB, NVML over the label)."""
    replicas: int = 1
    """Jobs the device plugin shares each card (or slice) among (time-slicing or MPS), from the
    replicas label; 1 for a card a job gets alone."""
    shared: bool = False
    """The labels say the card is shared (``-SHARED`` product, a sharing strategy, or
    replicas above 1)."""
    sharing_strategy: str = ""
    """The device plugin's ``nvidia.com/gpu.sharing-strategy`` (``time-slicing``, ``mps``);
    empty when not labelled."""


def read_node_labels(
    labels: Mapping[str, str], *, mig_profile: str | None, gpus: Sequence[GpuInfo]
) -> NodeDevice:
    """The card or MIG slice the labels describe, corrected by NVML when the reader sees it.

    Args:
        labels: the node's labels (``kubectl get node -o json``'s ``metadata.labels``).
        mig_profile: the MIG profile the job gets (e.g. ``"1g.5gb"``), or None for a whole GPU.
        gpus: this node's GPUs as the reader sees them; only NVML readings (not the CUDA
            runtime's or the host's) of the labelled product count. Empty when NVML is
            unavailable or the node is another one.

    Returns:
        The :class:`NodeDevice`.

    Raises:
        LabelError: the memory label is missing or not a number; the labels show MIG slices but
            no ``mig_profile`` was given, or the given profile is not among them; a replicas
            label that is not a whole number >= 1.
    """
    product = labels.get(GPU_PRODUCT_LABEL) or None
    shared_product = product is not None and product.upper().endswith(SHARED_SUFFIX)
    if product is not None and shared_product:
        product = product[: -len(SHARED_SUFFIX)] or None
    slices = {
        match["profile"]: value
        for key, value in labels.items()
        if (match := _MIG_MEMORY.match(key)) is not None
    }
    shown = ", ".join(f"{name} ({mib} MiB)" for name, mib in sorted(slices.items()))
    if mig_profile is None and slices:
        raise LabelError(
            f"the node shows MIG slices ({labels.get(MIG_STRATEGY_LABEL, 'mixed')} strategy): "
            f"{shown}; give device.mig_profile for the slice the job gets (a job on a slice has "
            "the slice's memory, not the card's), or device.capacity_bytes for a whole GPU",
            field="mig_profile",
        )
    if mig_profile is not None:
        if mig_profile not in slices:
            raise LabelError(
                f"mig_profile {mig_profile!r} is not among the node's MIG slices "
                f"({shown or 'none: no nvidia.com/mig-<profile>.memory label'})",
                field="mig_profile",
            )
        key = f"nvidia.com/mig-{mig_profile}.memory"
        name = None if product is None else f"{product}-MIG-{mig_profile}"
        replicas_key = f"nvidia.com/mig-{mig_profile}.replicas"
    else:
        key, name, replicas_key = GPU_MEMORY_LABEL, product, GPU_REPLICAS_LABEL
    replicas = _replicas(replicas_key, labels.get(replicas_key, ""))
    strategy = labels.get(SHARING_STRATEGY_LABEL, "")
    capacity, warnings = _memory_bytes(key, labels.get(key, ""))
    if name is not None:
        seen = [
            gpu
            for gpu in gpus
            if gpu.is_mig == (mig_profile is not None)
            and gpu.memory.memory_source == "nvml"
            and same_card(gpu.name, name)
        ]
        nvml_bytes = seen[0].memory.total_memory_bytes if seen else None
        if nvml_bytes is not None and abs(capacity - nvml_bytes) > NVML_TOLERANCE * nvml_bytes:
            warnings.append(
                f"label {key} says {format_bytes(capacity)}, but this node's NVML reads "
                f"{format_bytes(nvml_bytes)} for {seen[0].name} ({seen[0].uuid}), more than "
                f"{NVML_TOLERANCE:.0%} apart: planned for NVML's {nvml_bytes} bytes"
            )
            capacity = nvml_bytes
    return NodeDevice(
        capacity_bytes=capacity,
        name=name,
        warnings=tuple(warnings),
        replicas=replicas,
        shared=shared_product or replicas > 1 or strategy not in ("", "none"),
        sharing_strategy="" if strategy == "none" else strategy,
    )


def _replicas(key: str, value: str) -> int:
    """A replicas label's value; 1 when it is missing."""
    if not value:
        return 1
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise LabelError(
            f"label {key} must be the number of replicas each card is shared among (e.g. '4'), "
            f"got {value!r}",
            field=_field(key),
        )
    return int(value)


def _memory_bytes(key: str, value: str) -> tuple[int, list[str]]:
    """A GFD memory label's value in bytes, and a warning when it had to be read as bytes."""
    if not value:
        raise LabelError(f"label {key} (GPU memory in MiB) is missing", field=_field(key))
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise LabelError(
            f"label {key} must be the GPU memory in MiB (e.g. '81920'), got {value!r}",
            field=_field(key),
        )
    number = int(value)
    if number <= MAX_MIB:
        return number * 2**20, []
    if number > _MAX_BYTES:
        raise LabelError(
            f"label {key} {value!r} is neither MiB (at most {MAX_MIB}) nor a plausible byte "
            "count (at most 1 PiB); fix the label or give device.capacity_bytes",
            field=_field(key),
        )
    return number, [
        f"label {key} {value!r} is over {MAX_MIB}, which no card has in MiB: read as bytes "
        f"({format_bytes(number)}), as some GPU feature discovery versions wrote it"
    ]


def _field(key: str) -> str:
    return f"node_labels.{key}"
