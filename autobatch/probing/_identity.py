"""What a Profile records about the model, inputs and backend: the step's identity.

Example::

    model_fingerprint(torch.nn.Linear(4, 2))    # 16 hex digits, e.g. '3f0c...'
    step_identity(model, BatchSource.from_sample(x), None).cache_key(
        device_name="sim", total_memory_bytes=2**30)
"""

from __future__ import annotations

import functools
import hashlib
import types
from datetime import UTC, datetime

import torch

from autobatch.probing._batch import BatchSource
from autobatch.probing._checkpointing import CACHE_TURNED_OFF
from autobatch.profile import StepIdentity

__all__ = [
    "callable_identity",
    "model_fingerprint",
    "module_settings",
    "now_iso",
    "param_dtype",
    "step_fingerprint",
    "step_identity",
]


def model_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits of SHA-256 over the model's class, its parameters' and buffers' names,
    shapes, dtypes and ``requires_grad``, and each module's plain configuration (see
    :func:`module_settings`: a dropout's ``p``, Hugging Face's attention kernel...). Equal
    architectures with equal settings share it, in any process; weights do not matter, nor
    activation checkpointing (a recorded condition, :attr:`Conditions.activation_checkpointing`,
    so that a profile with it and one without are told apart by name)."""
    digest = hashlib.sha256(type(model).__module__.encode() + type(model).__qualname__.encode())
    for name, param in model.named_parameters():
        digest.update(
            f"p:{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode()
        )
    for name, buffer in model.named_buffers():
        digest.update(f"b:{name}:{tuple(buffer.shape)}:{buffer.dtype};".encode())
    for name, module in model.named_modules():
        digest.update(f"m:{name}:{type(module).__qualname__}:{module_settings(module)};".encode())
    return digest.hexdigest()[:16]


_MODULE_STATE_SKIPPED = frozenset({"training", "gradient_checkpointing"})
"""Public module (and module config) attributes left out of the fingerprint: ``training`` (the
probe sets and restores it) and Hugging Face's ``gradient_checkpointing`` (with its private
``_gradient_checkpointing_func``, a condition of the profile:
:func:`autobatch.probing._live_conditions.activation_checkpointing`)."""

_MODULE_PRIVATE_KEPT = frozenset({"_attn_implementation", "_attn_implementation_internal"})
"""Private module (and module config) attributes that change a step's memory (Hugging Face's
attention kernel), kept in the key though private. Other private state is left out: it may
differ in every process (a cached hash)."""

_MAX_TUPLE = 16
"""Longest tuple (or list) of plain values that counts as configuration."""


def _plain(value: object) -> str | None:
    """Text of a plain configuration value, the same in any process: None, a bool, int, float,
    str, ``torch.dtype``, a tuple or list of at most :data:`_MAX_TUPLE` of these, or a
    ``functools.partial`` of a function with plain arguments; None for anything else."""
    if value is None or isinstance(value, bool | int | float | str | torch.dtype):
        return repr(value)
    if isinstance(value, tuple | list) and len(value) <= _MAX_TUPLE:
        items = [_plain(item) for item in value]
        if all(item is not None for item in items):
            return f"({','.join(items)})"  # type: ignore[arg-type]
        return None
    if isinstance(value, functools.partial):
        arguments = [_plain(value.args), _plain(sorted(value.keywords.items()))]
        if all(item is not None for item in arguments):
            return f"partial({callable_identity(value.func)},{arguments[0]},{arguments[1]})"
    return None


def _plain_state(instance: object, *, private: bool, skipped: frozenset[str] = frozenset()) -> str:
    """Sorted ``name=value`` text of ``instance``'s plain attributes (see :func:`_plain`) in its
    ``__dict__``; names starting with ``_`` only when ``private``. Never its address."""
    found = []
    for name, value in _attributes(instance).items():
        if name in skipped:
            continue
        if name.startswith("_") and not private and name not in _MODULE_PRIVATE_KEPT:
            continue
        text = _plain(value)
        if text is not None:
            found.append(f"{name}={text}")
    return ",".join(sorted(found))


def _attributes(instance: object) -> dict[str, object]:
    """An object's attributes: its ``__dict__`` and any ``__slots__`` that are set."""
    found: dict[str, object] = {}
    for cls in type(instance).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(instance, name):
                found[name] = getattr(instance, name)
    state = getattr(instance, "__dict__", None)
    if isinstance(state, dict):
        found.update((str(name), value) for name, value in state.items())
    if found.get(CACHE_TURNED_OFF) is True:  # read as the model was given: it is a condition
        found["use_cache"] = True
    return found


def module_settings(module: torch.nn.Module) -> str:
    """A module's own plain configuration, as text the same in any process: its public
    attributes of simple types (bool, int, float, str, None, dtype and short tuples of them, e.g.
    ``in_features``, ``p``) plus Hugging Face's private attention settings; and, one level down,
    the same of a public configuration object it holds (Hugging Face's ``config``:
    ``set_attn_implementation`` changes only the config). Not ``training``, activation
    checkpointing (a condition, see :data:`_MODULE_STATE_SKIPPED`), tensors, submodules, hooks,
    containers, callables or other private state.

    Example::

        module_settings(torch.nn.Dropout(0.1))   # 'inplace=False,p=0.1'
    """
    own = _plain_state(module, private=False, skipped=_MODULE_STATE_SKIPPED)
    held = [
        f"{name}({_plain_state(value, private=False, skipped=_MODULE_STATE_SKIPPED)})"
        for name, value in sorted(module.__dict__.items())
        if not name.startswith("_") and _is_settings_object(value)
    ]
    return ";".join([own, *held]) if held else own


def _is_settings_object(value: object) -> bool:
    """An object with attributes that is not plain, a tensor, a module, a container, a class or
    a callable: a configuration object such as Hugging Face's ``PretrainedConfig``."""
    return (
        hasattr(value, "__dict__")
        and _plain(value) is None
        and not isinstance(value, torch.Tensor | torch.nn.Module | type | types.ModuleType)
        and not callable(value)
    )


def param_dtype(model: torch.nn.Module) -> str:
    """Dtype of the first floating-point parameter, e.g. ``"float32"``; ``""`` without one. (The
    bytes of every dtype are a condition: :attr:`Conditions.parameter_bytes`.)"""
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return ""


def now_iso() -> str:
    """The current UTC time, ISO-8601 to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def _code_digest(code: types.CodeType) -> str:
    """SHA-256 of a code object's bytecode, names and constants, nested code (lambdas, inner
    functions) by its own digest: no address, file or line, so the same in any process."""
    digest = hashlib.sha256(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            digest.update(b"code:" + _code_digest(const).encode())
        elif isinstance(const, frozenset):  # `x in {"a", "b"}`: its order follows the hash seed
            digest.update(repr(sorted(repr(item) for item in const)).encode())
        else:
            digest.update(repr(const).encode() + b";")
    return digest.hexdigest()


def callable_identity(function: object) -> str:
    """Text that names what a callable runs, the same in any process and never its address.

    A function (lambdas included): its name and :func:`_code_digest`. A bound method: its
    function and its object's plain state. A ``functools.partial``: its function and arguments.
    A builtin: its name. A callable object: its class, the code of the class's ``__call__`` (and
    ``forward``, for a module) and the object's plain attributes (see :func:`_plain`), private
    ones included; other attributes (tensors, modules, closures) by name only.
    """
    if function is None:
        return "-"
    if isinstance(function, types.MethodType):
        owner = function.__self__
        return f"{callable_identity(function.__func__)}@{_callable_id_of_object(owner)}"
    if isinstance(function, functools.partial):
        return _plain(function) or f"partial({callable_identity(function.func)},...)"
    code = getattr(function, "__code__", None)
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    if isinstance(code, types.CodeType):
        return f"{name}:{_code_digest(code)}"
    if isinstance(function, types.BuiltinFunctionType | type):
        return name
    return _callable_id_of_object(function)


def _callable_id_of_object(instance: object) -> str:
    """An object's class, the code of its ``__call__`` and ``forward`` and its plain state."""
    cls = type(instance)
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for method in ("__call__", "forward"):
        function = getattr(cls, method, None)
        if isinstance(getattr(function, "__code__", None), types.CodeType):
            parts.append(f"{method}={callable_identity(function)}")
    if isinstance(instance, torch.nn.Module):  # a loss module: its settings, as for the model
        parts.append(f"settings({module_settings(instance)})")
    else:
        others = sorted(
            name for name, value in _attributes(instance).items() if _plain(value) is None
        )
        parts.append(f"state({_plain_state(instance, private=True)};others={others})")
    return ":".join(parts)


def step_fingerprint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    loss_fn: object = None,
    train_step: object = None,
    step_includes_update: bool = False,
) -> str:
    """16 hex digits of SHA-256 over how a training step is formed: the loss function or train
    step (name and code; a callable object's class code and plain settings, never its address:
    see :func:`callable_identity`), ``step_includes_update``, the optimizer's class,
    hyperparameters and parameter groups (count and size), and the code of each module class's
    ``forward`` (so switching on gradient checkpointing in code changes it). Part of the cache
    key, the same in any process."""
    digest = hashlib.sha256()
    digest.update(
        f"loss={callable_identity(loss_fn)};step={callable_identity(train_step)};".encode()
    )
    digest.update(f"update={step_includes_update};".encode())
    if optimizer is None:
        digest.update(b"optimizer=AdamW(defaults);")
    else:
        defaults = sorted((k, repr(v)) for k, v in optimizer.defaults.items())
        digest.update(f"optimizer={type(optimizer).__qualname__}{defaults};".encode())
        for group in optimizer.param_groups:
            settings = sorted((k, repr(v)) for k, v in group.items() if k != "params")
            size = sum(p.numel() for p in group["params"])
            digest.update(f"group:{len(group['params'])}:{size}:{settings};".encode())
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        body = _code_digest(code) if isinstance(code, types.CodeType) else ""
        digest.update(f"{cls.__qualname__}:{body};".encode())
    return digest.hexdigest()[:16]


def step_identity(
    model: torch.nn.Module,
    source: BatchSource,
    optimizer: torch.optim.Optimizer | None,
    *,
    loss_fn: object = None,
    train_step: object = None,
    step_includes_update: bool = False,
    amp_dtype: torch.dtype | None = None,
) -> StepIdentity:
    """The one builder of a step's :class:`~autobatch.profile.StepIdentity`, shared by the probe,
    the estimate and ``autotune`` (so a profile's cache key is the one its request looks up).

    Args:
        model: the model (its fingerprint and parameter dtype).
        source: the micro-batch source (one sample's shapes and dtypes).
        optimizer: the user's optimizer; None stands for the default AdamW.
        loss_fn, train_step, step_includes_update: how the step is formed.
        amp_dtype: autocast dtype, None without AMP.
    """
    return StepIdentity(
        model_fingerprint=model_fingerprint(model),
        step_fingerprint=step_fingerprint(
            model,
            optimizer,
            loss_fn=loss_fn,
            train_step=train_step,
            step_includes_update=step_includes_update,
        ),
        input_shape=dict(source.sample_shapes),
        input_dtypes=dict(source.sample_dtypes),
        dtype=param_dtype(model),
        amp_dtype=str(amp_dtype).removeprefix("torch.") if amp_dtype is not None else "",
        optimizer=type(optimizer).__name__ if optimizer is not None else "AdamW",
        torch_version=torch.__version__,
    )
