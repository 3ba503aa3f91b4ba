"""Shared fixtures: small real models (transformers configs with random weights, a CNN with
BatchNorm, an MLP with Adam), an exhaustive-search reference on the simulated device, and a set
clock for every probe's fake steps."""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autobatch.device._resolve as device_resolve
import autobatch.probing._options as probe_options
from autobatch.device._oom import is_oom
from autobatch.device._simulated import SimulatedDevice
from autobatch.probing._batch import BatchSource
from autobatch.probing._snapshot import resident_tensors
from autobatch.probing._step import TrainingStep
from tests.helpers.clocks import TickingClock


@dataclasses.dataclass
class ModelCase:
    """A model, its sample and how its step is formed; ``build()`` gives fresh, seeded copies."""

    name: str
    build_model: Callable[[], torch.nn.Module]
    build_sample: Callable[[], Any]
    loss_fn: Callable[..., torch.Tensor] | None = None
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.AdamW(
        m.parameters()
    )

    def build(self) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = self.build_model()
        return model, self.build_sample(), self.optimizer(model)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    return GPT2LMHeadModel(config)


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        num_labels=10,
    )
    return ViTForImageClassification(config)


def _tokens(rows: int = 2, length: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (rows, length))
    return {"input_ids": ids, "labels": ids}


MODEL_CASES = [
    ModelCase(
        "mlp-adam",
        _mlp,
        lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))),
        loss_fn=F.cross_entropy,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    ),
    ModelCase(
        "cnn-batchnorm",
        _cnn,
        lambda: (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))),
        loss_fn=F.cross_entropy,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    ),
    ModelCase("gpt2-tiny", _gpt2, _tokens),
    ModelCase(
        "bert-tiny",
        _bert,
        lambda: {
            "input_ids": torch.randint(0, 256, (2, 32)),
            "attention_mask": torch.ones(2, 32, dtype=torch.long),
            "labels": torch.randint(0, 3, (2,)),
        },
    ),
    ModelCase(
        "vit-tiny",
        _vit,
        lambda: {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2,))},
    ),
]


@pytest.fixture(params=MODEL_CASES, ids=lambda case: case.name)
def model_case(request: pytest.FixtureRequest) -> ModelCase:
    return request.param  # type: ignore[no-any-return]


def exhaustive_max(case: ModelCase, capacity_bytes: int, *, limit: int = 4096) -> int:
    """Largest n such that every size 1..n fits, by trying each size in turn on a fresh copy
    (the reference the probe must match). The optimizer state is created first, as in training."""
    model, sample, optimizer = case.build()
    model.train()
    step = TrainingStep(model, optimizer, loss_fn=case.loss_fn)
    source = BatchSource.from_sample(sample)
    step.run(source.make(1))  # optimizer state present from here on
    device = SimulatedDevice(capacity_bytes=capacity_bytes)
    largest = 0
    for size in range(1, limit + 1):
        resident = resident_tensors(model, optimizer)
        try:
            with device.measure(resident):
                step.run(source.make(size))
        except Exception as exc:
            if not is_oom(exc):
                raise
            break
        largest = size
    return largest


@pytest.fixture
def sim_capacity_for() -> Callable[[ModelCase, int], int]:
    """Capacity (bytes) at which ``case`` fits about ``target`` samples, from the estimator."""
    from autobatch.probing._estimator import FakeStep

    def capacity(case: ModelCase, target: int) -> int:
        model, sample, optimizer = case.build()
        fake = FakeStep(model, optimizer, BatchSource.from_sample(sample), loss_fn=case.loss_fn)
        return fake.peak_bytes(target) + 4096

    return capacity


@pytest.fixture
def set_allocator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Changes the allocator settings in effect as torch's own API does
    (``torch.cuda.memory._set_allocator_settings``), with the allocator variables unset, and
    restores the settings afterwards."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    before = torch._C._accelerator_getAllocatorSettings()
    yield torch._C._accelerator_setAllocatorSettings
    torch._C._accelerator_setAllocatorSettings(before)


def spawn_and_wait(
    worker: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float
) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; fail the test, and kill
    them, when they do not all finish within ``timeout_s`` (a hang fails instead of blocking)."""
    import os
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{nprocs} processes did not finish within {timeout_s} s (a hang)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                os.kill(proc.pid, 9)
                proc.join()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Hide what collection loaded (torch, transformers, the test modules: about 400,000
    objects) from the garbage collector.

    A probe runs ``gc.collect()`` before every trial (``Device.release``), and a full collection
    walks every one of them, which outweighs a small probe's own steps. Objects the tests create
    are collected as usual.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_a_test_module_leaves() -> Iterator[None]:
    """The same, after each test module, for what it imported lazily (torch's fake tensors,
    Dynamo, sympy) and what stays alive for the session."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """The URL of a fresh PostgreSQL database, dropped afterwards (``tests/helpers/postgres.py``:
    skips, naming what is missing, when no server answers, unless told it is required)."""
    from tests.helpers.postgres import postgres_database

    with postgres_database() as url:
        yield url


@pytest.fixture(autouse=True, scope="session")
def _a_private_profile_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reads or writes the profile store of the user who runs the suite: the default
    store (``$XDG_CACHE_HOME/autobatch``) is a folder of this session's, and ``AUTOBATCH_STORE``
    is unset (a test that wants one sets it). Before, a test that autotuned with the default
    store failed where another checkout had left a newer store in ``~/.cache``; the servers and
    CLIs the tests start inherit this too."""
    saved = {name: os.environ.get(name) for name in ("AUTOBATCH_STORE", "XDG_CACHE_HOME")}
    os.environ.pop("AUTOBATCH_STORE", None)
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


FAKE_STEP_SECONDS = 0.001
"""How long each fake step of an estimate lasts on the suite's set clock."""

NAMED_SIM_STEP_SECONDS = 1.0
"""How long each real step of a simulated card named by a string (``"sim:64MiB"``) lasts on its
clock in this process: a dear step, as :class:`SimulatedDevice`'s own default, never the wall
clock (which made whether an estimate ran depend on the machine's load)."""


@pytest.fixture(autouse=True)
def _probes_on_a_set_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every probe a test makes in this process times its fake steps on a clock that advances
    by :data:`FAKE_STEP_SECONDS` a step, not on the wall clock: whether an estimate starts and
    where it stops is then the same on any machine, loaded or not. A simulated card named by a
    string counts each real step at :data:`NAMED_SIM_STEP_SECONDS` for the same reason. A test
    that gives its own clock (``ProbeOptions.build(clock=...)``), or undoes ``monkeypatch``, is on
    that one."""
    monkeypatch.setattr(probe_options, "DEFAULT_CLOCK", TickingClock(seconds=FAKE_STEP_SECONDS))
    monkeypatch.setattr(device_resolve, "NAMED_SIM_STEP_SECONDS", NAMED_SIM_STEP_SECONDS)
