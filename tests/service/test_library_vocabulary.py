"""The service speaks the library's vocabulary: every choice a schema offers (a ``Literal``) and
every range it bounds a library number to is the library's own, walked over every pydantic model
the service defines, so a copy cannot come back unseen."""

from __future__ import annotations

import importlib
import pkgutil
import typing
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import service
from autobatch.device import (
    MAX_GPU_FRACTION,
    MIN_GPU_FRACTION,
    BudgetSource,
    CardMemory,
    CardSource,
    MemorySource,
    SharingMode,
    check_gpu_fraction,
)
from autobatch.errors import ConfigError
from autobatch.margin import MAX_SAFETY_MARGIN, MIN_SAFETY_MARGIN
from autobatch.planning import (
    MAX_GRADIENT_ACCUMULATION_STEPS,
    AskedCheckpointing,
    Match,
    PlanSource,
    Uneven,
)
from autobatch.profile import (
    PROFILE_SCHEMA_VERSION,
    CheckpointingMode,
    Clock,
    Compiled,
    Method,
    Mode,
    StopKind,
    SyncMode,
)
from service.probes.runs import ProbeRunStatus as ProbeRunStatus

PROFILE_CHOICES = {
    "method": Method,
    "stop_kind": StopKind,
    "mode": Mode,
    "compiled": Compiled,
    "activation_checkpointing": CheckpointingMode,
}
LIBRARY_CHOICES: dict[tuple[str, str], Any] = {
    ("BudgetReadingBase", "source"): BudgetSource,
    ("DeviceSpec", "memory"): CardMemory,
    ("GpuPublic", "memory_source"): MemorySource,
    ("GradientSyncFields", "mode"): SyncMode,
    ("MemoryBudgetBase", "deciding_source"): BudgetSource,
    ("MemoryBudgetBase", "sharing_mode"): SharingMode,
    ("PlanCreate", "uneven"): Uneven,
    ("PlanCreate", "activation_checkpointing"): AskedCheckpointing,
    ("PlanFields", "source"): PlanSource,
    ("PlanFields", "activation_checkpointing"): CheckpointingMode,
    ("ProbeTimingsFields", "clock"): Clock,
    ("ResolvedDevice", "source"): CardSource,
    ("ResolvedDevice", "deciding_source"): BudgetSource,
    ("ResolvedDevice", "sharing_mode"): SharingMode,
    ("SelectionPublic", "match"): Match,
    **{
        (model, field): kind
        for model in ("ProfileBase", "ProfileCreate")
        for field, kind in PROFILE_CHOICES.items()
    },
}
"""Every choice a service schema offers that is a library concept, and the library's type."""

SERVICE_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("AdmissionPublic", "outcome"): ("accepted", "sized", "unreachable", "unplanned"),
    ("HealthPublic", "status"): ("ok",),
    ("InputSpec", "dtype"): ("float32", "float16", "bfloat16", "int64", "int32", "bool"),
    ("ModelEntry", "loss"): (
        "cross_entropy",
        "mse_loss",
        "l1_loss",
        "binary_cross_entropy_with_logits",
    ),
    ("ProbePublic", "status"): typing.get_args(ProbeRunStatus),
    ("Settings", "log_level"): ("critical", "error", "warning", "info", "debug", "trace"),
}
"""The service's own choices: an admission's outcome, a liveness answer, the model registry's
inputs and losses (the server's configuration file), a probe run's status, uvicorn's log levels."""

LIBRARY_RANGES: dict[tuple[str, str], tuple[type, float, float]] = {
    ("DeviceSpec", "gpu_fraction"): (annotated_types.Gt, MIN_GPU_FRACTION, MAX_GPU_FRACTION),
    ("PlanCreate", "gpu_fraction"): (annotated_types.Gt, MIN_GPU_FRACTION, MAX_GPU_FRACTION),
    ("PlanCreate", "max_gradient_accumulation_steps"): (
        annotated_types.Ge,
        1,
        MAX_GRADIENT_ACCUMULATION_STEPS,
    ),
    ("ProfileBase", "schema_version"): (annotated_types.Ge, 1, PROFILE_SCHEMA_VERSION),
    ("ProfileCreate", "schema_version"): (annotated_types.Ge, 1, PROFILE_SCHEMA_VERSION),
}
"""Numbers the library bounds, each field's lower bound (its kind and value) and upper one
(inclusive)."""


def service_models() -> dict[str, type[BaseModel]]:
    """Every pydantic model defined in a module of the service, by name."""
    found: dict[str, type[BaseModel]] = {}
    for info in pkgutil.walk_packages(service.__path__, "service."):
        if info.name.endswith("__main__"):
            continue
        for value in vars(importlib.import_module(info.name)).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseModel)
                and value.__module__.startswith("service.")
            ):
                assert found.setdefault(value.__qualname__, value) is value, value.__qualname__
    return found


MODELS = service_models()


def choices(annotation: Any) -> list[tuple[Any, ...]]:
    """The ``Literal``s in ``annotation``, through unions, ``Annotated`` and containers."""
    if typing.get_origin(annotation) is typing.Literal:
        return [typing.get_args(annotation)]
    return [found for arg in typing.get_args(annotation) for found in choices(arg)]


def bounds(info: FieldInfo) -> list[Any]:
    """A field's ``annotated_types`` bounds, its own and those of an ``Annotated`` type inside
    an optional one (``GpuFraction | None``)."""
    found = list(info.metadata)
    for arg in typing.get_args(info.annotation):
        for meta in getattr(arg, "__metadata__", ()):
            found.extend(meta.metadata if isinstance(meta, FieldInfo) else [meta])
    kinds = (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le)
    return [meta for meta in found if isinstance(meta, kinds)]


def test_the_walk_finds_the_schemas_of_every_feature() -> None:
    assert {"PlanCreate", "ProbePublic", "ProfileCreate", "GpuPublic", "ReadyPublic"} <= set(MODELS)


def strays(models: dict[str, type[BaseModel]]) -> list[tuple[str, str]]:
    """The fields of ``models`` offering choices that are neither the library's type named for
    them nor listed as the service's own."""
    expected = {key: typing.get_args(kind) for key, kind in LIBRARY_CHOICES.items()}
    expected |= SERVICE_CHOICES
    return sorted(
        (name, field)
        for name, model in models.items()
        for field, info in model.model_fields.items()
        if (found := choices(info.annotation)) and expected.get((name, field)) != found[0]
    )


def test_every_choice_a_schema_offers_is_the_librarys_or_named_as_the_services_own() -> None:
    assert strays(MODELS) == []
    offered = {
        (name, field)
        for name, model in MODELS.items()
        for field, info in model.model_fields.items()
        if choices(info.annotation)
    }
    assert offered == set(LIBRARY_CHOICES) | set(SERVICE_CHOICES)


def test_the_walk_catches_a_planted_copy_that_drifted() -> None:
    class PlanCreate(BaseModel):
        uneven: typing.Literal["auto", "never"] = "auto"  # one choice short of the library's

    class Unlisted(BaseModel):
        shape: typing.Literal["square"] | None = None

    assert strays({"PlanCreate": PlanCreate, "Unlisted": Unlisted}) == [
        ("PlanCreate", "uneven"),
        ("Unlisted", "shape"),
    ]


def test_a_choice_the_library_gains_reaches_the_schema() -> None:
    # A copy would keep its own list: the schema's is the library's type itself.
    assert typing.get_args(MODELS["PlanCreate"].model_fields["uneven"].annotation) == (
        "auto",
        "never",
        "always",
    )
    assert MODELS["ResolvedDevice"].model_fields["source"].annotation is CardSource
    assert MODELS["SelectionPublic"].model_fields["match"].annotation is Match


def test_every_range_of_a_library_number_is_the_librarys() -> None:
    for (name, field), (lower_kind, lower, upper) in LIBRARY_RANGES.items():
        found = bounds(MODELS[name].model_fields[field])
        lows = [meta for meta in found if isinstance(meta, annotated_types.Gt | annotated_types.Ge)]
        highs = [meta for meta in found if isinstance(meta, annotated_types.Le)]
        assert [type(meta) for meta in lows] == [lower_kind], (name, field)
        low = lows[0]
        assert (low.gt if isinstance(low, annotated_types.Gt) else low.ge) == lower, (name, field)
        assert [meta.le for meta in highs] == [upper], (name, field)


def test_the_gpu_fraction_bounds_are_the_ones_the_library_checks() -> None:
    assert check_gpu_fraction(MAX_GPU_FRACTION) == 1.0
    with pytest.raises(ConfigError, match=r"must be a number in \(0, 1\]"):
        check_gpu_fraction(MIN_GPU_FRACTION)


def test_the_safety_margin_states_the_librarys_range() -> None:
    schema = MODELS["PlanCreate"].model_json_schema()["properties"]["safety_margin"]
    margin = next(option for option in schema["anyOf"] if option.get("type") == "number")
    assert margin["minimum"] == MIN_SAFETY_MARGIN
    assert margin["exclusiveMaximum"] == MAX_SAFETY_MARGIN
