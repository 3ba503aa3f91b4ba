"""The one comparison of conditions (a table), the allocator settings' canonical form, and the
launcher's data-parallel size: all pure."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from autobatch.conditions import (
    Conditions,
    condition_changes,
    launcher_world_size,
    normalized_allocator_settings,
)
from autobatch.errors import ConfigError
from autobatch.profile import Profile, StepIdentity

CUDA = Conditions(
    device_type="cuda",
    allocator_settings="expandable_segments:True",
    allocator_source="torch",
    allocator_backend="native",
    allocator_environment={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    cudnn={"benchmark": "False", "deterministic": "False", "enabled": "True"},
    amp_dtype="bfloat16",
    parameter_bytes={"bfloat16": 2000},
    gradient_bytes={"bfloat16": 2000},
    num_parameters=1000,
    num_trainable_parameters=1000,
    activation_checkpointing="none detected",
    optimizer="torch.optim.adamw.AdamW",
    optimizer_state_dtype="float32",
    world_size=1,
    world_size_source="one process",
)
SIM = dataclasses.replace(CUDA, device_type="sim")


def changed(base: Conditions, **fields: Any) -> Conditions:
    return dataclasses.replace(base, **fields)


# (case, recorded, live, world_size, the names of the changes found)
TABLE: list[tuple[str, Conditions, Conditions, int | None, list[str]]] = [
    ("the same conditions", CUDA, CUDA, None, []),
    ("not recorded: nothing compared", Conditions(), changed(CUDA, amp_dtype="off"), None, []),
    (
        "allocator settings in effect",
        CUDA,
        changed(CUDA, allocator_settings=""),
        None,
        ["allocator settings in effect"],
    ),
    (
        "the newer variable name, same settings in effect",
        CUDA,
        changed(CUDA, allocator_environment={"PYTORCH_ALLOC_CONF": "expandable_segments:True"}),
        None,
        [],
    ),
    (
        "allocator settings do not apply on a simulated card",
        SIM,
        changed(SIM, allocator_settings=""),
        None,
        [],
    ),
    (
        "allocator settings unknown (torch not loaded)",
        CUDA,
        changed(CUDA, allocator_source="", allocator_settings=""),
        None,
        [],
    ),
    (
        "allocator backend",
        CUDA,
        changed(CUDA, allocator_backend="cudaMallocAsync"),
        None,
        ["allocator backend"],
    ),
    (
        "cudnn.benchmark",
        CUDA,
        changed(CUDA, cudnn={**CUDA.cudnn, "benchmark": "True"}),
        None,
        ["cudnn.benchmark"],
    ),
    ("cuDNN does not run on the CPU", SIM, changed(SIM, cudnn={"benchmark": "True"}), None, []),
    ("AMP", CUDA, changed(CUDA, amp_dtype="off"), None, ["amp_dtype"]),
    ("AMP unknown (a training loop)", CUDA, changed(CUDA, amp_dtype=""), None, []),
    (
        "parameters stored in another dtype",
        SIM,
        changed(SIM, parameter_bytes={"float32": 4000}, gradient_bytes={"float32": 4000}),
        None,
        ["parameter bytes", "gradient bytes"],
    ),
    (
        "frozen parameters",
        SIM,
        changed(SIM, num_trainable_parameters=10, gradient_bytes={"bfloat16": 20}),
        None,
        ["gradient bytes", "trainable parameters"],
    ),
    (
        "activation checkpointing",
        SIM,
        changed(SIM, activation_checkpointing="checkpoint_wrapper around 2 modules"),
        None,
        ["activation checkpointing"],
    ),
    (
        "an 8-bit paged optimizer",
        SIM,
        changed(
            SIM,
            optimizer="bitsandbytes.optim.adamw.PagedAdamW8bit",
            optimizer_state_dtype="uint8",
        ),
        None,
        ["optimizer", "optimizer state dtype"],
    ),
    (
        "optimizer state before its first step: unknown",
        SIM,
        changed(SIM, optimizer_state_dtype=""),
        None,
        [],
    ),
    (
        "a plan's world size against the launcher",
        SIM,
        changed(SIM, world_size=2),
        1,
        ["world_size"],
    ),
    ("a profile has no world size to compare", SIM, changed(SIM, world_size=2), None, []),
    ("world size unknown here", SIM, changed(SIM, world_size=0), 4, []),
    (
        "a plan from a number is still checked for its world size",
        Conditions(),
        SIM,
        2,
        ["world_size"],
    ),
]


@pytest.mark.parametrize(
    ("recorded", "live", "world_size", "names"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_condition_changes(
    recorded: Conditions, live: Conditions, world_size: int | None, names: list[str]
) -> None:
    changes = condition_changes(recorded, live, world_size=world_size)
    assert [change.name for change in changes] == names
    for change in changes:
        assert change.recorded != change.live
        assert change.kind == ("batch" if change.name == "world_size" else "memory")


def test_a_change_names_both_values_and_a_fix_not_already_in_effect() -> None:
    live = changed(CUDA, cudnn={**CUDA.cudnn, "benchmark": "True"})
    (change,) = condition_changes(CUDA, live)
    assert change.describe() == (
        "cudnn.benchmark: measured with False, this process has True; set "
        "torch.backends.cudnn.benchmark = False before training, or tune again with True"
    )
    (amp,) = condition_changes(CUDA, changed(CUDA, amp_dtype="off"))
    assert "autocast to torch.bfloat16 as measured" in amp.fix
    assert "amp_dtype=None" in amp.fix  # what the live process runs, never bfloat16 again


def test_a_variable_set_after_torch_read_its_settings_is_named() -> None:
    live = changed(
        CUDA,
        allocator_settings="",
        allocator_environment={"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
    )
    assert live.ignored_allocator_variables == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    (change,) = condition_changes(CUDA, live)
    assert "PYTORCH_ALLOC_CONF='expandable_segments:True' is set but not in effect" in change.fix
    assert "start the process with PYTORCH_ALLOC_CONF=expandable_segments:True" in change.fix
    assert "is set but not in effect" in "\n".join(live.describe())


def test_the_key_holds_what_moves_memory_on_the_device_and_is_known_before_a_step() -> None:
    key = CUDA.key()
    assert key["cudnn"] == {"benchmark": "False", "deterministic": "False", "enabled": "True"}
    assert key["allocator_settings"] == "expandable_segments:True"
    assert "optimizer_state_dtype" not in key  # unknown until the first step
    assert "world_size" not in key  # per-rank memory: sharding shows in the bytes
    assert "cudnn" not in SIM.key() and "allocator_settings" not in SIM.key()
    assert Conditions().key() == {}


def test_conditions_join_the_cache_key_and_survive_a_round_trip() -> None:
    profile = Profile(
        max_micro_batch_size=8,
        recommended_micro_batch_size=8,
        safety_margin=0.05,
        method="probe",
        trials=(),
        num_steps=1,
        device_name="NVIDIA H200",
        device_type="cuda",
        total_memory_bytes=2**30,
        capacity_bytes=2**30,
        identity=StepIdentity(model_fingerprint="m"),
        conditions=CUDA,
    )
    again = Profile.from_dict(profile.to_dict())
    assert again == profile
    benchmarked = dataclasses.replace(
        profile, conditions=changed(CUDA, cudnn={**CUDA.cudnn, "benchmark": "True"})
    )
    assert benchmarked.cache_key() != profile.cache_key()
    state = dataclasses.replace(profile, conditions=changed(CUDA, optimizer_state_dtype="uint8"))
    assert state.cache_key() == profile.cache_key()
    old = profile.to_dict()
    del old["conditions"]  # a profile written before conditions were recorded
    assert Profile.from_dict(old).conditions == Conditions()


def test_conditions_from_dict_refuses_unknown_fields() -> None:
    with pytest.raises(ConfigError, match=r"unknown fields \['allocator'\]"):
        Conditions.from_dict({"allocator": "x"})


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("", ""),
        ("expandable_segments:True", "expandable_segments:True"),
        (
            "max_split_size_mb:128, expandable_segments:True",
            "expandable_segments:True,max_split_size_mb:128",
        ),
        (
            "roundup_power2_divisions:[256:1,>:4],backend:native",
            "backend:native,roundup_power2_divisions:[256:1,>:4]",
        ),
    ],
)
def test_allocator_settings_compare_in_one_form(text: str, normalized: str) -> None:
    assert normalized_allocator_settings(text) == normalized


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, None),
        (
            {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"},
            (2, "the launcher's environment (WORLD_SIZE=2, RANK=1, LOCAL_RANK=1)"),
        ),
        ({"WORLD_SIZE": "8"}, (8, "the launcher's environment (WORLD_SIZE=8)")),
    ],
)
def test_the_launcher_sets_the_data_parallel_size(
    environ: dict[str, str], expected: tuple[int, str] | None
) -> None:
    assert launcher_world_size(environ) == expected


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_launcher_world_size_is_named(value: str) -> None:
    with pytest.raises(ConfigError, match=f"WORLD_SIZE '{value}' in the environment"):
        launcher_world_size({"WORLD_SIZE": value})
