"""Tensor-parallel models probed on a real allocator (device "cpu") on 2 gloo ranks: one rank runs
out of memory in the middle of the forward, after the step's first all-reduce, at sizes where
the other does not, and neither waits for the other (every process group is faked while a step
runs), the module runs the next trial, and both ranks get one answer. FSDP1, whose per-step state
a step stopped in the middle leaves broken, is still refused there, saying why. The process
group's timeout is short, so a rank left waiting fails the test instead of blocking it.

The out-of-memory error is raised by a forward hook (``torch.OutOfMemoryError``, as the CUDA
caching allocator raises it): the CPU device's own would need the host's memory to run out."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autobatch.distributed._layout import collective_layout
from autobatch.profile import Trial
from autobatch.tuning import tune
from tests.conftest import spawn_and_wait
from tests.helpers.gloo_exit import join_gloo_group, leave_gloo_worker

GROUP_TIMEOUT_S = 20
"""The process group's timeout: a rank left in a collective would wait this long, then fail."""

FITS_UP_TO = (40, 24)
"""Per rank, the largest micro-batch whose forward does not raise out-of-memory."""


def _tensor_parallel_mlp(mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )
    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()
    ]


def _worker(rank: int, world_size: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    join_gloo_group(rank, world_size, f"{tmp}/rendezvous", timeout_s=GROUP_TIMEOUT_S)
    result: dict[str, Any] = {}
    try:
        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        result["tp"] = _probed(rank, _tensor_parallel_mlp(tp))
        # 2-D: FSDP2 over a data-parallel dimension of 1, tensor parallel over 2.
        two_d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        for where in ("forward", "backward"):
            model = fully_shard(_tensor_parallel_mlp(two_d), mesh=two_d["dp"])
            result[f"2d_{where}"] = _probed(rank, model, backward=where == "backward")
        result["fsdp1"] = _fsdp1_refused()
        total = torch.tensor([float(rank + 1)])  # the real default group is back
        dist.all_reduce(total)
        result["sum"] = float(total)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    leave_gloo_worker()


def _probed(rank: int, model: torch.nn.Module, *, backward: bool = False) -> dict[str, Any]:
    """tune() on device "cpu" with a forward hook after the row-wise layer (whose output the
    step all-reduces) raising out-of-memory above this rank's FITS_UP_TO: right there (mid-forward),
    or with ``backward`` once the gradient reaches that output (mid-backward)."""
    from torch.distributed.fsdp import FSDPModule

    reached: list[int] = []  # sizes whose step ran the row-wise layer's all-reduce

    def out_of_memory(*_: Any) -> None:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; raised by the test)"
        )

    def out_of_memory_above(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        size = int(inputs[0].shape[0])
        reached.append(size)
        if size <= FITS_UP_TO[rank]:
            return
        if backward:  # once the gradient reaches this layer's output
            output.register_hook(out_of_memory)
        else:
            out_of_memory()

    torch.manual_seed(1)  # the same sample on both ranks (tensor-parallel peers share it)
    sample = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    expected = model(sample[0]).detach()
    if isinstance(model, FSDPModule):  # as after a training step: not left unsharded
        model.reshard()
    before = _state(model)
    hook = model[2].register_forward_hook(out_of_memory_above)  # after the all-reduce's hook
    trials: list[Trial] = []
    started = time.monotonic()
    try:
        tuned = tune(
            model,
            sample,
            effective_batch_size=64,
            data_parallel_size=1,  # both ranks are one tensor-parallel group
            loss_fn=F.cross_entropy,
            device="cpu",
            use_store=False,
            on_trial=trials.append,
        )
    except Exception as exc:
        return {"error": [type(exc).__name__, str(exc)], "seconds": time.monotonic() - started}
    finally:
        hook.remove()
    seconds = time.monotonic() - started
    return {
        "layout": collective_layout(model),
        "seconds": seconds,
        "max_micro_batch_size": tuned.profile.max_micro_batch_size,
        "plan": tuned.plan.to_dict(),
        "trials": [[t.micro_batch_size, t.fits, t.oom] for t in trials],
        "reached": reached,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True)),
        # The row-wise layer all-reduces for real again: the same output as before the probe.
        "same_output": torch.equal(model(sample[0]).detach(), expected),
    }


def _fsdp1_refused() -> list[Any]:
    """FSDP1 on device "cpu": the error's type, message and seconds to raise it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model = FullyShardedDataParallel(mlp, device_id=torch.device("cpu"), use_orig_params=True)
    started = time.monotonic()
    try:
        tune(
            model,
            (torch.randn(8, 32), torch.randint(0, 10, (8,))),
            effective_batch_size=64,
            loss_fn=F.cross_entropy,
            device="cpu",
            use_store=False,
        )
    except Exception as exc:
        return [type(exc).__name__, str(exc), time.monotonic() - started]
    return ["no error", "", time.monotonic() - started]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tp_oom")
    spawn_and_wait(_worker, (2, str(tmp)), 2, timeout_s=4 * GROUP_TIMEOUT_S)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def _check_one_agreed_answer(first: dict[str, Any], second: dict[str, Any], layout: str) -> None:
    assert "error" not in first and "error" not in second, (first, second)
    assert first["layout"] == second["layout"] == layout
    # Both ranks ran the same sizes; rank 1 ran out of memory, after the row-wise layer's
    # all-reduce, at sizes where rank 0 went on to the end of its step.
    assert [size for size, *_ in first["trials"]] == [size for size, *_ in second["trials"]]
    diverged = [
        size
        for (size, _, oom0), (_, _, oom1) in zip(first["trials"], second["trials"], strict=True)
        if oom1 and not oom0
    ]
    assert diverged and all(FITS_UP_TO[1] < size <= FITS_UP_TO[0] for size in diverged)
    assert all(size in first["reached"] and size in second["reached"] for size in diverged)
    # Neither waited for the group's timeout, and both agree on rank 1's limit.
    assert first["seconds"] < GROUP_TIMEOUT_S and second["seconds"] < GROUP_TIMEOUT_S
    assert first["max_micro_batch_size"] == second["max_micro_batch_size"] == FITS_UP_TO[1]
    assert first["plan"] == second["plan"]
    assert first["plan"]["micro_batch_size"] <= FITS_UP_TO[1]
    assert first["unchanged"] and second["unchanged"]
    assert first["same_output"] and second["same_output"]


@pytest.mark.slow
def test_tensor_parallel_on_cpu_with_one_rank_out_of_memory_mid_forward_agrees(
    ranks: list[dict[str, Any]],
) -> None:
    first, second = (rank["tp"] for rank in ranks)
    _check_one_agreed_answer(first, second, "tensor parallel (DTensor parameters)")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fsdp2_with_tensor_parallel_on_cpu_recovers_from_an_oom_mid_step(
    ranks: list[dict[str, Any]], where: str
) -> None:
    first, second = (rank[f"2d_{where}"] for rank in ranks)
    _check_one_agreed_answer(first, second, "FSDP2 (fully_shard) with tensor parallel")


@pytest.mark.slow
def test_fsdp1_on_cpu_is_still_refused_naming_its_per_step_state(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        name, message, seconds = rank["fsdp1"]
        assert name == "ConfigError", rank["fsdp1"]
        assert "FSDP (FullyShardedDataParallel) on 2 ranks of cpu" in message
        assert "per-step state" in message and "no call to reset" in message
        assert "waiting" not in message  # no longer the reason
        for alternative in ("FSDP2 (fully_shard)", "device='sim:", "single rank", "plan("):
            assert alternative in message
        assert seconds < GROUP_TIMEOUT_S
        assert rank["sum"] == 3.0  # a real collective after all of it
