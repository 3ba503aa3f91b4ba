"""The device set this process was given, and CUDA's numbering of it: one pure resolver.

NVML numbers every GPU on the machine in PCI order (``nvml_index``). The set this process may
use is ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA container runtime's variable: UUIDs, MIG UUIDs,
indices, ``all``, ``none``; ``void`` or empty, which CDI sets, leave the set to what NVML sees),
then ``CUDA_VISIBLE_DEVICES`` read over it the way the CUDA driver reads it, in the order
``CUDA_DEVICE_ORDER`` asks for. :func:`resolve_visible` does it for the listing, the service's
plans, its probe jobs and the library (:class:`~autobatch.device._nvml.Nvml`). Imports neither
torch nor pynvml.

Example::

    resolved = resolve_visible(devices, {"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb"})
    resolved.cuda_order      # ('GPU-bbbb',): cuda:0 is the card the pod was given
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autobatch.device._types import GpuInfo, MemoryInfo

__all__ = ["NvmlDevice", "VisibleDevices", "cuda_visible_devices", "resolve_visible"]

CUDA_VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
NVIDIA_VISIBLE_VAR = "NVIDIA_VISIBLE_DEVICES"
CUDA_ORDER_VAR = "CUDA_DEVICE_ORDER"


def fastest_first(environ: Mapping[str, str]) -> bool:
    """Whether CUDA numbers the fastest GPU first (its default) rather than in PCI order."""
    return environ.get(CUDA_ORDER_VAR, "FASTEST_FIRST").strip() != "PCI_BUS_ID"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NvmlDevice:
    """One NVML device (a physical GPU or a MIG instance) before its memory is read."""

    nvml_index: int
    uuid: str
    name: str
    handle: Any = dataclasses.field(repr=False, compare=False)
    is_mig: bool = False
    parent_uuid: str = ""
    mig_enabled: bool = False
    """A physical GPU in MIG mode: CUDA sees its instances, not the GPU itself."""
    mig_slot: int | None = None
    """A MIG instance's index under its parent (``NVIDIA_VISIBLE_DEVICES=0:1`` names slot 1)."""
    mig_profile: str = ""
    cuda_index: int | None = None
    given: bool = True

    def info(self, memory: MemoryInfo, *, reason: str = "", detail: str = "") -> GpuInfo:
        """This device as a :class:`GpuInfo` with ``memory`` (and why it is not NVML's)."""
        return GpuInfo(
            nvml_index=self.nvml_index,
            cuda_index=self.cuda_index,
            uuid=self.uuid,
            name=self.name,
            memory=memory,
            is_mig=self.is_mig,
            parent_uuid=self.parent_uuid,
            mig_profile=self.mig_profile,
            given=self.given,
            memory_reason=reason,
            memory_detail=detail,
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisibleDevices:
    """The device set this process was given, resolved by :func:`resolve_visible`."""

    cuda_order: tuple[str, ...]
    """UUIDs in CUDA's numbering: ``cuda_order[i]`` is ``cuda:i``."""
    given: frozenset[str]
    """UUIDs (GPUs and MIG instances) the container was given."""
    note: str = ""
    """Why some GPUs NVML sees are not given, or how the order was chosen; empty when simple."""


def _leading_int(token: str) -> int | None:
    """``strtoul``-style: ``"1gpu"`` is 1, ``"x"`` and ``"-1"`` are None."""
    digits = ""
    for char in token.lstrip("+"):
        if not char.isdigit():
            break
        digits += char
    return int(digits) if digits else None


def _is_index(token: str) -> bool:
    """An ``NVIDIA_VISIBLE_DEVICES`` index: ``"3"``, or ``"3:1"`` for a MIG instance."""
    gpu_text, colon, slot_text = token.partition(":")
    return (
        gpu_text.isascii()
        and gpu_text.isdigit()
        and (not colon or (slot_text.isascii() and slot_text.isdigit()))
    )


def _given_uuids(spec: str | None, devices: Sequence[NvmlDevice]) -> tuple[set[str], str]:
    """UUIDs named by ``NVIDIA_VISIBLE_DEVICES=spec`` (None: unset), and a note on what was left.

    Indices are the host's NVML indices, as the container runtime reads them. Inside a container
    the runtime exposes only the given cards and NVML renumbers them from 0, so when NVML sees
    exactly as many GPUs as the list names distinct indices, they are all given.
    """
    all_uuids = {device.uuid for device in devices}
    text = "" if spec is None else spec.strip().lower()
    if spec is None or text == "all":
        return all_uuids, ""
    if text in ("", "void"):
        # The NVIDIA runtime then acts as runc and gives no device itself; the cards NVML sees
        # came another way: CDI, which sets "void" (a Dynamic Resource Allocation claim, the
        # device plugin's CDI mode), or --device. They are the container's, as when unset.
        note = (
            f"{NVIDIA_VISIBLE_VAR}={spec!r}: the NVIDIA runtime named no device; the GPUs NVML "
            "sees were given through CDI (a DRA claim, the device plugin's CDI mode)"
        )
        return all_uuids, note if all_uuids else ""
    if text == "none":
        return set(), f"{NVIDIA_VISIBLE_VAR}={spec!r}: this container was given no GPU"
    physical = [device for device in devices if not device.is_mig]
    tokens = [token.strip() for token in spec.split(",") if token.strip()]
    if len(physical) == len(tokens) == len(set(tokens)) and all(
        _is_index(token) for token in tokens
    ):
        return all_uuids, ""  # the runtime exposed exactly these cards, renumbered by NVML
    given: set[str] = set()
    unknown: list[str] = []
    for token in tokens:
        found: list[NvmlDevice]
        if token.startswith(("GPU-", "MIG-")):
            found = [device for device in devices if device.uuid == token]
        else:
            gpu_text, _, slot_text = token.partition(":")
            found = [
                device
                for device in devices
                if gpu_text.isdigit()
                and device.nvml_index == int(gpu_text)
                and (
                    device.mig_slot == int(slot_text)
                    if slot_text.isdigit()
                    else not device.is_mig and not slot_text
                )
            ]
        if not found:
            unknown.append(token)
        for device in found:
            given.add(device.uuid)
            if not device.is_mig:  # a whole GPU brings its MIG instances
                given.update(d.uuid for d in devices if d.parent_uuid == device.uuid)
    notes = []
    if unknown:
        notes.append(f"{NVIDIA_VISIBLE_VAR} names devices NVML does not see: {', '.join(unknown)}")
    num_extra = sum(not device.is_mig and device.uuid not in given for device in devices)
    if num_extra:
        notes.append(
            f"NVML sees {num_extra} GPU(s) this container was not given ({NVIDIA_VISIBLE_VAR}="
            f"{spec!r}; a privileged pod sees every card): they are listed with given=false and "
            "never planned on"
        )
    return given, "; ".join(notes)


def _cuda_uuid_of(device: NvmlDevice, devices: Sequence[NvmlDevice], given: set[str]) -> str | None:
    """The UUID CUDA shows for ``device``: a GPU in MIG mode shows its first given instance."""
    if not device.mig_enabled:
        return device.uuid if device.uuid in given else None
    children = [d.uuid for d in devices if d.parent_uuid == device.uuid and d.uuid in given]
    return children[0] if children else None


def _keep_one_mig(uuids: list[str], devices: Sequence[NvmlDevice]) -> list[str]:
    """CUDA 11 and 12 enumerate at most one MIG instance per process (NVIDIA MIG user guide)."""
    mig_uuids = {device.uuid for device in devices if device.is_mig}
    kept: list[str] = []
    seen_mig = False
    for uuid in uuids:
        if uuid in mig_uuids:
            if seen_mig:
                continue
            seen_mig = True
        kept.append(uuid)
    return kept


def resolve_visible(
    devices: Sequence[NvmlDevice],
    environ: Mapping[str, str],
    *,
    speed: Mapping[str, float] | None = None,
) -> VisibleDevices:
    """The device set and CUDA's numbering of it: the one resolver of visible devices.

    Args:
        devices: every NVML device in NVML order, each GPU in MIG mode followed by its instances.
        environ: where ``NVIDIA_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES`` and
            ``CUDA_DEVICE_ORDER`` are read.
        speed: a physical GPU's relative speed (CUDA cores x max SM clock) by UUID, for
            ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` (CUDA's default) on a node with different cards;
            None or missing entries keep PCI order.

    Follows the CUDA driver for ``CUDA_VISIBLE_DEVICES``: entries are indices into the default
    order or unique prefixes of ``GPU-``/``MIG-`` UUIDs of given devices; the first invalid
    entry ends the list; a repeated device empties it.
    """
    given, note = _given_uuids(environ.get(NVIDIA_VISIBLE_VAR), devices)
    physical = [device for device in devices if not device.is_mig]
    # A MIG instance given without its GPU stands in the GPU's place.
    slots = [_cuda_uuid_of(device, devices, given) for device in physical]
    names = {device.name for device in physical if device.uuid in given}
    if fastest_first(environ) and speed and len(names) > 1:
        ranked = sorted(
            range(len(physical)), key=lambda i: -speed.get(physical[i].uuid, float("-inf"))
        )
        slots = [slots[i] for i in ranked]
        note = "; ".join(
            filter(
                None,
                [
                    note,
                    "different GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers "
                    "the fastest first, ranked here by CUDA cores x max SM clock; set "
                    "CUDA_DEVICE_ORDER=PCI_BUS_ID to make the numbering exact",
                ],
            )
        )
    default = _keep_one_mig([uuid for uuid in slots if uuid is not None], devices)
    spec = environ.get(CUDA_VISIBLE_VAR)
    if spec is None:
        return VisibleDevices(cuda_order=tuple(default), given=frozenset(given), note=note)
    order: list[str] = []
    for raw_token in spec.split(","):
        token = raw_token.strip()
        uuid: str | None
        if token.startswith(("GPU-", "MIG-")):
            matches = [d for d in devices if d.uuid.startswith(token) and d.uuid in given]
            uuid = _cuda_uuid_of(matches[0], devices, given) if len(matches) == 1 else None
        else:
            index = _leading_int(token)
            uuid = default[index] if index is not None and index < len(default) else None
        if uuid is None:
            break
        if uuid in order:
            order = []
            break
        order.append(uuid)
    return VisibleDevices(
        cuda_order=tuple(_keep_one_mig(order, devices)), given=frozenset(given), note=note
    )


def cuda_visible_devices(resolved: VisibleDevices) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that makes a child process's ``cuda:i`` this
    resolver's ``cuda_index`` i (UUIDs, so it holds in a privileged pod that sees every card);
    ``""`` (no device) when nothing was given."""
    return ",".join(resolved.cuda_order)
