"""Where a probe runs: the model's one device, and the check that model and sample are on the
device to probe (a probe never moves them).

Example::

    target = resolve_device("sim:2GiB", default=model_device(model))
    check_placement(model, BatchSource.from_sample(sample), target)
"""

from __future__ import annotations

import torch

from autobatch.device import Device
from autobatch.errors import ConfigError
from autobatch.probing._batch import BatchSource

__all__ = ["check_placement", "model_device"]


def check_placement(model: torch.nn.Module, source: BatchSource, target: Device) -> None:
    """The model and the sample are on the device to probe (a probe never moves them).

    Raises:
        ConfigError: either is elsewhere (names both devices and the fix), or the model spans
            devices or has no tensors.
    """
    placed = model_device(model)
    if _normal(target.torch_device) != _normal(placed):
        raise ConfigError(
            f"the model is on {placed} but the device to probe is {target.name} "
            f"({target.torch_device}); move the model with model.to({str(target.torch_device)!r})"
        )
    if _normal(source.device) != _normal(placed):
        raise ConfigError(
            f"the model is on {placed} but the sample is on {source.device}; move the "
            f"sample with .to({str(placed)!r})"
        )


def model_device(model: torch.nn.Module) -> torch.device:
    """The one device holding the model's parameters and buffers.

    Raises:
        ConfigError: the model has no tensors, or spans devices.
    """
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if not devices:
        raise ConfigError(
            f"model {type(model).__name__} has no parameters or buffers; there is nothing to "
            "train, so nothing to probe"
        )
    if len(devices) > 1:
        raise ConfigError(
            f"model {type(model).__name__} spans devices {sorted(map(str, devices))}; probe a "
            "model on one device (model-parallel models are not supported)"
        )
    return devices.pop()


def _normal(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
