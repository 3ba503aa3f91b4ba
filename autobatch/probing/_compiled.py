"""torch.compile and the probe: which step is measured, and how Dynamo is left untouched.

Dynamo skips a frame called while a ``TorchDispatchMode`` is active and remembers the skip on the
frame's code object, so that model, and every later model whose forward is the same code (any
``nn.Sequential``), never compiles again in the process. The simulated and CPU devices count
bytes with a dispatch mode (:class:`~autobatch.device._live_bytes.LiveBytes`) and the estimator
traces
under ``FakeTensorMode``; there the step runs under :func:`eager` (``torch.compiler.set_stance
("force_eager")``: Dynamo is not entered, so nothing is recorded), and one compiled step at the
chosen size confirms that it compiles and runs. CUDA reads memory from allocator statistics,
without a mode, so there the trials run the compiled step itself, with the batch dimension
marked dynamic so that trying many sizes compiles once, not once per size.

Example::

    cm = torch.compile(model)
    is_compiled(cm)                      # True
    with eager():
        cm(x)                            # runs model eagerly; Dynamo's caches are not touched
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from autobatch.profile import Compiled

__all__ = [
    "CompiledMode",
    "compiled_mode",
    "eager",
    "is_compiled",
    "mark_batch_dynamic",
    "measures_compiled",
]

CompiledMode = Compiled
"""How a compiled step was probed; see :attr:`autobatch.Profile.compiled`."""


def is_compiled(model: torch.nn.Module) -> bool:
    """True when calling ``model`` enters torch.compile: it, or one of its submodules, is a
    ``torch.compile(module)`` wrapper or was compiled in place (``module.compile()``)."""
    # Not imported means nothing was compiled; importing Dynamo would slow every gc.collect().
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper: type[Any] | None = getattr(eval_frame, "OptimizedModule", None)
    return any(
        (wrapper is not None and isinstance(module, wrapper))
        or module._compiled_call_impl is not None
        for module in model.modules()
    )


def compiled_mode(model: torch.nn.Module, device_type: str) -> CompiledMode:
    """How a probe of ``model`` on a device of ``device_type`` runs its step: ``""`` (not
    compiled), ``"measured"`` or ``"confirmed"``; see :attr:`autobatch.Profile.compiled`."""
    if not is_compiled(model):
        return ""
    return "measured" if measures_compiled(device_type) else "confirmed"


def measures_compiled(device_type: str) -> bool:
    """True when a device of this type measures memory without a dispatch mode (CUDA allocator
    statistics), so that trials can run the compiled step itself."""
    return device_type == "cuda"


@contextmanager
def eager() -> Iterator[None]:
    """Run every torch.compile'd function and module eagerly inside the block, without entering
    Dynamo (nothing compiles, nothing is recorded as skipped). The previous stance is restored.
    Without Dynamo imported nothing was compiled, and the block runs as it is."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def mark_batch_dynamic(batch: Any) -> None:
    """Mark dim 0 of every tensor in ``batch`` as (maybe) dynamic, so that Dynamo compiles one
    graph for all micro-batch sizes instead of one per size. Size 1 is still specialised."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(leaf, 0)
