"""Under nccl the probe's agreement uses the probed GPU, not the current CUDA device (cuda:0 on a
rank that never called set_device: another rank's GPU). Fakes on the CPU: the backend's name and
the current-device query are injected, so no GPU is needed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from autobatch.distributed._consensus import ProcessGroupConsensus, consensus_device
from autobatch.errors import DistributedError
from autobatch.probing._parallel import on_cuda_device


def _no_current_device() -> int:
    raise AssertionError("the current CUDA device was asked for")


@pytest.mark.parametrize(
    ("backend", "probed", "bound", "want"),
    [
        ("gloo", torch.device("cuda", 1), None, torch.device("cpu")),
        ("nccl", torch.device("cuda", 1), None, torch.device("cuda", 1)),
        ("nccl", torch.device("cuda", 3), torch.device("cuda", 3), torch.device("cuda", 3)),
        ("nccl", torch.device("cpu"), torch.device("cuda", 2), torch.device("cuda", 2)),
    ],
)
def test_the_agreement_goes_to_the_probed_gpu(
    backend: str, probed: torch.device, bound: torch.device | None, want: torch.device
) -> None:
    got = consensus_device(
        backend, probed=probed, bound=bound, current_cuda_index=_no_current_device
    )
    assert got == want


def test_a_simulated_card_under_nccl_falls_back_to_the_current_device() -> None:
    got = consensus_device(
        "nccl", probed=torch.device("cpu"), bound=None, current_cuda_index=lambda: 5
    )
    assert got == torch.device("cuda", 5)


def test_a_group_bound_to_another_gpu_is_refused_naming_both() -> None:
    with pytest.raises(
        DistributedError, match=r"probes cuda:1 but its process group is bound to cuda:0"
    ):
        consensus_device(
            "nccl",
            probed=torch.device("cuda", 1),
            bound=torch.device("cuda", 0),
            current_cuda_index=_no_current_device,
        )


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_consensus_under_nccl_uses_the_device_it_is_given(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", _no_current_device)

    consensus = ProcessGroupConsensus(device=torch.device("cuda", 1))

    assert consensus.device == torch.device("cuda", 1)


def test_the_probed_gpu_is_the_current_device_during_the_trials_only() -> None:
    pinned = on_cuda_device(torch.device("cuda", 1))
    assert isinstance(pinned, torch.cuda.device) and pinned.idx == 1
    assert not isinstance(on_cuda_device(torch.device("cpu")), torch.cuda.device)
