"""The node name a profile records: the cluster's variables first, the host name last."""

from __future__ import annotations

import socket

import pytest

from autobatch.device import NODE_NAME_ENV_VARS, SimulatedDevice, node_name


@pytest.fixture(autouse=True)
def _no_node_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in NODE_NAME_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def test_falls_back_to_the_host_name() -> None:
    assert node_name() == socket.gethostname()


@pytest.mark.parametrize("var", NODE_NAME_ENV_VARS)
def test_each_variable_names_the_node(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "  gpu-node-7 ")
    assert node_name() == "gpu-node-7"


def test_autobatch_variable_wins_and_empty_ones_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AUTOBATCH_NODE_NAME", "")
    monkeypatch.setenv("NODE_NAME", "k8s-node")
    monkeypatch.setenv("SLURMD_NODENAME", "slurm-node")
    assert node_name() == "k8s-node"
    monkeypatch.setenv("AUTOBATCH_NODE_NAME", "mine")
    assert node_name() == "mine"


def test_a_probe_records_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import autobatch

    monkeypatch.setenv("NODE_NAME", "node-a")
    model = torch.nn.Linear(8, 2)
    profile = autobatch.probe(
        model,
        (torch.randn(1, 8), torch.randn(1, 2)),
        loss_fn=torch.nn.functional.mse_loss,
        device=SimulatedDevice(capacity_bytes=2**20),
        max_micro_batch_size=64,
    )
    assert profile.node_name == "node-a"
    assert autobatch.Profile.from_dict(profile.to_dict()).node_name == "node-a"
    assert profile.schema_version == 4  # model_name joined in version 4
