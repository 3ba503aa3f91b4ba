"""The server's model registry: the only models a probe run may run, read from a TOML file.

A request names a registered model; it never names code. Each entry gives a factory
(``module:function``, called with no arguments, returning a ``torch.nn.Module``), the input spec of
one sample, and the device to probe on. Factories run only inside the probe run's child process.

Example file::

    [models.tiny-mlp]
    factory = "examples.models:tiny_mlp"
    device = "sim:64MiB"                   # or "cuda:0", "cpu"
    loss = "cross_entropy"                 # tuple sample (input, target) with this loss
    max_micro_batch_size = 4096
    effective_batch_size = 512             # optional: no probe tries more than 512 / world_size
    [models.tiny-mlp.inputs.input]
    shape = [32]                           # one sample, without the batch dimension
    dtype = "float32"
    [models.tiny-mlp.inputs.target]
    shape = []
    dtype = "int64"
    high = 10                              # integers drawn from [0, high)

Without ``loss``, the sample is a dict of the inputs and the model's output must carry ``.loss``
(Hugging Face style), e.g. ``inputs.input_ids`` and ``inputs.labels``.

Usage::

    registry = load_registry(Path("models.toml"))
    registry.models["tiny-mlp"].device
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from autobatch.device import parse_device
from autobatch.errors import ConfigError
from autobatch.margin import DEFAULT_SAFETY_MARGIN
from autobatch.planning import largest_useful_micro_batch_size
from service.web.schemas import DeviceName, SafetyMargin

__all__ = [
    "REGISTRY_SEARCH_LIMIT",
    "InputSpec",
    "ModelEntry",
    "Registry",
    "cuda_index",
    "load_registry",
]


def cuda_index(device: str) -> int | None:
    """The CUDA index of a ``cuda:N`` device (``"cuda:01"`` is 1); None for ``cpu`` and
    ``sim:SIZE``. ``device`` was checked by :data:`DeviceName`."""
    return parse_device(device).cuda_index


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
LossName = Literal["cross_entropy", "mse_loss", "l1_loss", "binary_cross_entropy_with_logits"]


REGISTRY_SEARCH_LIMIT = 4096
"""The search cap of a registered model's probe runs unless its entry says otherwise (the
entry's ``max_micro_batch_size``). Lower than the library's
``autobatch.probing.DEFAULT_SEARCH_LIMIT`` (65,536) on purpose: a probe run is a server's
work, one at a time per GPU in a child process under a timeout, so the cap bounds the largest
batch it builds and the trials it spends before the timeout; a model whose micro-batch on one
card may pass 4,096 says so in its entry (up to 2**20)."""


class InputSpec(BaseModel):
    """One input tensor of a sample: its shape without the batch dimension, dtype, value range."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[Annotated[int, Field(ge=1, le=1 << 20)]] = Field(max_length=8)
    dtype: Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"] = "float32"
    high: int = Field(default=2, ge=1, le=1 << 31)
    """Integer inputs are drawn from ``[0, high)``; ignored for floating point."""


class ModelEntry(BaseModel):
    """A registered model: how to build it, its sample, and where to probe it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factory: str
    """``module:function`` returning a ``torch.nn.Module``."""
    inputs: dict[str, InputSpec] = Field(min_length=1)
    loss: LossName | None = None
    """A ``torch.nn.functional`` loss: the sample is ``(inputs["input"], inputs["target"])``."""
    device: DeviceName = "cpu"
    max_micro_batch_size: int = Field(default=REGISTRY_SEARCH_LIMIT, ge=1, le=1 << 20)
    """The search cap of this model's probe runs: the largest micro-batch a probe tries (not a
    measured maximum); :attr:`search_limit` lowers it further for a known effective batch."""
    effective_batch_size: int | None = Field(default=None, ge=1)
    """The job's effective batch size, when known: no probe tries a micro-batch above
    ``ceil(effective_batch_size / world_size)``, which no plan for it could use."""
    world_size: int = Field(default=1, ge=1)
    """Data-parallel ranks of that job (only bounds the sizes probed)."""
    safety_margin: SafetyMargin = DEFAULT_SAFETY_MARGIN
    use_estimate: bool = True

    @property
    def search_limit(self) -> int:
        """The search cap a probe run of this model uses: the largest micro-batch it tries."""
        if self.effective_batch_size is None:
            return self.max_micro_batch_size
        useful = largest_useful_micro_batch_size(self.effective_batch_size, self.world_size)
        return min(self.max_micro_batch_size, useful)

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str) -> str:
        if not _FACTORY.match(value):
            raise ValueError(f"factory {value!r} must be 'module.path:function'")
        return value

    @model_validator(mode="after")
    def _loss_inputs(self) -> ModelEntry:
        if self.loss is not None and set(self.inputs) != {"input", "target"}:
            raise ValueError(
                f"with loss {self.loss!r} the inputs must be exactly 'input' and 'target', "
                f"got {sorted(self.inputs)}"
            )
        return self


class Registry(BaseModel):
    """The whole file: ``[models.<name>]`` tables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")], ModelEntry
    ] = Field(default_factory=dict)


def load_registry(path: Path | None) -> Registry:
    """Read and validate the registry file; an empty registry when ``path`` is None.

    Raises:
        ConfigError: the file cannot be read, is not TOML, or an entry is invalid (names the
            entry, the field and the reason).
    """
    if path is None:
        return Registry()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the model registry {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the model registry {path} is not valid TOML: {exc}") from exc
    try:
        registry = Registry.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        raise ConfigError(f"the model registry {path} is invalid: {problems}") from exc
    for name, entry in registry.models.items():
        _check_importable(name, entry.factory, path)
    return registry


def _check_importable(name: str, factory: str, path: Path) -> None:
    """Fail at start, not at the first probe, when a factory's module cannot be found.

    Finds the module without running it (``importlib.util.find_spec``; parent packages are
    imported), so the server does not import torch or the user's model code.
    """
    module = factory.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"the model registry {path}: model {name!r}: cannot find module {module!r} (factory "
            f"{factory!r}) on the import path; start the server from the directory that holds "
            f"it, or add that directory to PYTHONPATH"
        )
