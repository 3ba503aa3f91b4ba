"""Small models for the service's probe-job tests, named in registries by ``module:function``."""

from __future__ import annotations

import time

import torch


def tiny_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def slow_mlp() -> torch.nn.Module:
    """Takes a minute to build: a job that is still running when a test kills it."""
    time.sleep(60)
    return tiny_mlp()


def sleepy_mlp() -> torch.nn.Module:
    """Takes 4 s to build, then probes in a second or two: a job whose profile lands in the
    store a few seconds after it started, unless its process is gone by then."""
    time.sleep(4)
    return tiny_mlp()


REGISTRY_TOML = """
[models.tiny-mlp]
factory = "tests.service.models:tiny_mlp"
device = "sim:8MiB"
loss = "cross_entropy"
max_micro_batch_size = 4096
[models.tiny-mlp.inputs.input]
shape = [32]
[models.tiny-mlp.inputs.target]
shape = []
dtype = "int64"
high = 10

[models.slow-mlp]
factory = "tests.service.models:slow_mlp"
device = "sim:8MiB"
loss = "cross_entropy"
[models.slow-mlp.inputs.input]
shape = [32]
[models.slow-mlp.inputs.target]
shape = []
dtype = "int64"
high = 10
"""
"""A registry with both models on a simulated 8 MiB device."""
