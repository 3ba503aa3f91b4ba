"""Exceptions raised by autobatch.

Every error autobatch raises on purpose derives from :class:`AutobatchError`::

    AutobatchError
    ├── ConfigError (also ValueError)  bad argument or input; names the value and the fix
    │   ├── MissingExtraError          an optional dependency is not installed (also ImportError)
    │   └── PeerObjectError            a probed step needs another rank's data (faked collectives)
    ├── DeviceUnavailableError         no such device, no NVML/driver, device query failed
    ├── DoesNotFitError                the training step does not fit even at micro-batch 1
    ├── StepFailedError                the user's step failed for a reason other than OOM
    ├── EstimateUnavailableError       the step cannot run on fake tensors (the probe falls back)
    ├── NoFeasiblePlanError            no (micro-batch, accumulation) split meets the constraints
    ├── StoreError                     the profile store is corrupt, newer, or unwritable
    │   └── ProfileNotFoundError       no profile has that id (also a KeyError)
    ├── DistributedError               a rank failed or ranks disagreed during a collective probe
    └── ServiceError                   the HTTP service refused or failed a call (client side)

Warnings (``UserWarning``): :class:`ReportWarning` (``autotune(report_to=...)`` could not register
the profile), :class:`SmallMicroBatchNormWarning` (BatchNorm over small micro-batches),
:class:`ConditionsWarning` (a plan used under other conditions than it was measured in).

NVML's exceptions (``pynvml.NVMLError_*``) are translated at the device boundary only
(``autobatch.device._nvml``), with ``raise ... from exc``. Out-of-memory is classified, not
translated: :func:`autobatch.device._oom.is_oom` is the one place that decides which exceptions
(``torch.OutOfMemoryError``, cuBLAS/cuDNN allocation failures, the CPU allocator's) mean OOM, for
the probe's trials (``autobatch.probing._prober``) and the training loop's splits
(``autobatch.training._oom_split``); any other exception propagates.

An error that a changed argument would get past carries that change as structured
:class:`Remedy` values (``exc.remedies``) rather than in its text, so that each surface names it
in its own terms, in one place per surface: ``str(exc)`` words it for Python
(``allow_inexact=True``), the CLI as a flag (``--allow-inexact``), the service as a JSON field
(``"allow_inexact": true``), each through :meth:`AutobatchError.describe`.

Example::

    try:
        profile = autobatch.probe(model, sample, device="sim:2GiB")
    except autobatch.DoesNotFitError as exc:
        print(exc.required_bytes, exc.capacity_bytes)
    except autobatch.ConfigError as exc:
        print(exc.message, [remedy.parameter for remedy in exc.remedies])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "AutobatchError",
    "ConditionsWarning",
    "ConfigError",
    "DeviceUnavailableError",
    "DistributedError",
    "DoesNotFitError",
    "EstimateUnavailableError",
    "MissingExtraError",
    "NoFeasiblePlanError",
    "PeerObjectError",
    "ProfileDeletedError",
    "ProfileNotFoundError",
    "Remedy",
    "ReportWarning",
    "ServiceError",
    "SmallMicroBatchNormWarning",
    "StepFailedError",
    "StoreError",
    "python_wording",
    "with_remedies",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Remedy:
    """One way past an error, named by the library's argument; each surface words it.

    Example: ``Remedy(parameter="allow_inexact", values=(True,), purpose="plan the nearest")``
    reads ``allow_inexact=True (plan the nearest)`` in Python and ``--allow-inexact (plan the
    nearest)`` on the command line.
    """

    parameter: str = ""
    """The library argument to change (``"allow_inexact"``, ``"amp_dtype"``,
    ``"effective_batch_size"``); empty for a remedy no argument expresses (a larger device)."""
    values: tuple[object, ...] = ()
    """Values to give it, in the library's terms: ``(True,)``, ``(96, 100)``; a dtype by its
    torch name, ``("bfloat16",)``."""
    purpose: str = ""
    """What it does, in plain words (``"reduced precision"``); for a remedy without
    ``parameter``, the whole remedy (``"a larger device"``)."""

    def __post_init__(self) -> None:
        if not (self.parameter and self.values) and not (self.purpose and not self.values):
            raise ValueError(f"{self!r} needs a parameter and values, or a purpose alone")


def python_wording(remedy: Remedy) -> str:
    """A remedy in Python's terms, as ``str(exc)`` shows it: ``amp_dtype=torch.bfloat16``."""
    if not remedy.parameter:
        return remedy.purpose
    shown = (f"torch.{v}" if remedy.parameter == "amp_dtype" else repr(v) for v in remedy.values)
    phrase = f"{remedy.parameter}={' or '.join(shown)}"
    return f"{phrase} ({remedy.purpose})" if remedy.purpose else phrase


def with_remedies(reason: str, remedies: Sequence[Remedy], word: Callable[[Remedy], str]) -> str:
    """``reason``, then ``"; use A, B, or C"`` with each remedy worded by ``word``."""
    phrases = [word(remedy) for remedy in remedies]
    if not phrases:
        return reason
    if len(phrases) > 1:
        phrases = [", ".join(phrases[:-1]), phrases[-1]]
    return f"{reason}; use {', or '.join(phrases)}"


class _Remedied(Exception):
    """A message with remedies, each surface wording them: the part :class:`AutobatchError` and
    :class:`ReportWarning` share (an exception, a warning).

    Args:
        message: what went wrong, with the numbers; the fix too, unless it is in ``remedies``.
        remedies: changed arguments that get past it, for each surface to word.
    """

    def __init__(self, message: str, *, remedies: Sequence[Remedy] = ()) -> None:
        super().__init__(message)
        self.remedies: tuple[Remedy, ...] = tuple(remedies)
        """Ways past the error, named by library argument; see :meth:`describe`."""

    @property
    def message(self) -> str:
        """The message without the remedies."""
        return str(self.args[0]) if self.args else ""

    def describe(self, word: Callable[[Remedy], str]) -> str:
        """The message with each remedy worded by ``word``, one surface's wording.

        Args:
            word: e.g. :func:`python_wording`; the CLI's names flags, the service's JSON fields.
        """
        return with_remedies(self.message, self.remedies, word)

    def __str__(self) -> str:
        return self.describe(python_wording)


class AutobatchError(_Remedied):
    """Root of every error autobatch raises on purpose (its message and remedies:
    :class:`_Remedied`)."""


class ConfigError(AutobatchError, ValueError):
    """An argument or input is invalid. The message names the value and how to fix it."""


class DeviceUnavailableError(AutobatchError):
    """The device cannot be used: unknown name, no driver/NVML, or a failed query.

    Attributes:
        reason: a stable code a program can switch on, e.g. ``"driver_library_mismatch"``
            or ``"gpu_lost"`` (``autobatch.device._nvml.REASONS`` lists NVML's, each with its
            fix); ``"device_unavailable"`` when nothing more specific is known.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str = "device_unavailable",
        remedies: Sequence[Remedy] = (),
    ) -> None:
        super().__init__(message, remedies=remedies)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_device_unavailable, (self.message, self.reason, self.remedies)


def _rebuild_device_unavailable(
    message: str, reason: str, remedies: Sequence[Remedy] = ()
) -> DeviceUnavailableError:
    return DeviceUnavailableError(message, reason=reason, remedies=remedies)


class DoesNotFitError(AutobatchError):
    """The whole training step does not fit on the device even at micro-batch 1 (or, when
    splitting a micro-batch of a model with BatchNorm in training mode, at 2: its least).

    Attributes:
        device_name: the device probed.
        capacity_bytes: bytes the step may use on it.
        required_bytes: bytes the step needed when it failed (a lower bound), 0 if unknown.
        static_bytes: the model's resident footprint (weights, gradients, optimizer state), bytes.
    """

    def __init__(
        self,
        message: str,
        *,
        device_name: str,
        capacity_bytes: int,
        required_bytes: int,
        static_bytes: int,
        remedies: Sequence[Remedy] = (),
    ) -> None:
        super().__init__(message, remedies=remedies)
        self.device_name = device_name
        self.capacity_bytes = capacity_bytes
        self.required_bytes = required_bytes
        self.static_bytes = static_bytes


class StepFailedError(AutobatchError):
    """The training step raised something other than out-of-memory.

    Attributes:
        micro_batch_size: the size at which it failed.
    """

    def __init__(self, message: str, *, micro_batch_size: int) -> None:
        super().__init__(message)
        self.micro_batch_size = micro_batch_size


class NoFeasiblePlanError(AutobatchError):
    """No split of the effective batch meets every constraint; names the nearest reachable ones."""


class StoreError(AutobatchError):
    """The profile store cannot be used: corrupt file, newer schema, or not writable.

    Attributes:
        reason: what failed, in words that name no location and quote no driver (``"cannot
            store a profile: the database server cannot be reached or refused the login"``),
            for answers to clients that may not see the store's address; empty when the
            message has nothing to say beyond "the store cannot be used".
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class DistributedError(AutobatchError):
    """A rank failed or the ranks disagreed while probing under torch.distributed."""


class ServiceError(AutobatchError):
    """The service refused or failed a call for a reason with no closer autobatch error
    (401 bad token, 409 queue full, 5xx, unreachable server).

    Attributes:
        status: the HTTP status, 0 when no response came.
        problem: the problem details body, empty when none.
    """

    def __init__(self, message: str, *, status: int, problem: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.problem = dict(problem or {})


class EstimateUnavailableError(AutobatchError):
    """The step cannot run on fake tensors (an op without a fake kernel, data-dependent control
    flow, a custom optimizer that cannot be rebuilt). The probe then falls back to doubling."""


class ProfileNotFoundError(StoreError, KeyError):
    """No profile has the given id. Also a ``KeyError``, as for a missing mapping key.

    Attributes:
        profile_id: the id asked for.
    """

    def __init__(self, message: str, *, profile_id: str) -> None:
        super().__init__(message)
        self.profile_id = profile_id

    def __str__(self) -> str:
        # KeyError.__str__ would quote the message; show it as every other StoreError does.
        return str(self.args[0])


class ProfileDeletedError(StoreError):
    """The profile was deleted from this store (it holds its tombstone), so it is not stored
    again: a resend (an outbox's retry) or a copy fetched before the deletion stays deleted.
    Publish a new profile (a new probe) instead.

    Attributes:
        profile_id: the deleted profile's id.
    """

    def __init__(self, message: str, *, profile_id: str) -> None:
        super().__init__(message, reason="the profile was deleted")
        self.profile_id = profile_id


class MissingExtraError(ConfigError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the
    extra that installs it (:func:`autobatch.extras.require` raises it). Also an
    ``ImportError``, as the failed import it stands for.

    Attributes:
        extra: the extra to install, e.g. ``"postgres"``.
        module: the module that could not be imported, e.g. ``"psycopg"`` (also ``.name``).
    """

    def __init__(self, message: str, *, extra: str = "", module: str = "") -> None:
        super().__init__(message)
        self.extra = extra
        self.module = module
        self.name = module


class PeerObjectError(ConfigError):
    """While the probe faked the collectives, the step called something that needs the other
    ranks: an object collective whose receivers need another rank's object, or the creation of
    a process group (see :func:`autobatch.distributed._fake_backend.process_groups_faked`)."""


# Warnings: categories to filter or catch with ``warnings``.


class ReportWarning(_Remedied, UserWarning):
    """``autotune(report_to=...)`` could not register the profile; the plan is still returned.

    Args:
        message: what failed, naming the service, with the numbers.
        remedies: ways past it, each surface words them (as :class:`AutobatchError`'s).
    """


class SmallMicroBatchNormWarning(UserWarning):
    """The model has BatchNorm layers in training mode and the micro-batches are small.

    BatchNorm normalises with the statistics of one forward pass, i.e. one micro-batch, so
    accumulation does not reproduce the large batch's behaviour for those layers.
    """


class ConditionsWarning(UserWarning):
    """A plan is used in a process whose conditions that move memory (allocator settings,
    cuDNN flags, dtypes, optimizer, activation checkpointing...) differ from the ones it was
    measured in, so its micro-batch may not fit; or activation checkpointing changed nothing.
    The message names each condition, both values and the fix (see :mod:`autobatch.conditions`).
    """
