"""bench/_stacks.py, the compiled and FSDP2 cases of bench/gpu_check.py, run here as in its dry
run: a simulated device, Dynamo's cheap "eager" backend, a one-rank gloo group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from autobatch import SimulatedDevice
from autobatch.device import Device
from bench._stacks import check_compiled, check_fsdp2, format_stacks


def _device() -> Device:
    return SimulatedDevice(capacity_bytes=4 << 20)


@pytest.mark.slow
def test_the_compiled_case_probes_eagerly_confirms_compiled_and_leaves_dynamo_working() -> None:
    row = check_compiled(_device, backend="eager", width=32, depth=2)

    assert row["ok"] and row["compiled"] == "confirmed"
    assert row["compiled_max_micro_batch_size"] == row["eager_max_micro_batch_size"] > 1
    assert row["frames_in_probe"] == 1  # the confirming step only
    assert row["frames_after_probe"] == 1 and row["frames_of_a_later_model"] == 1
    assert format_stacks([row]).startswith("compiled (eager)       ok ")


@pytest.mark.slow
def test_the_fsdp2_case_plans_and_trains_on_one_rank() -> None:
    row = check_fsdp2(_device, width=32, depth=2)

    assert row["ok"], row
    assert row["micro_batch_size"] * row["gradient_accumulation_steps"] == 4096
    assert len(row["losses"]) == 3
    assert not dist.is_initialized()  # the group is gone again
