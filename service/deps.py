"""The app's shared objects, handed to routes as one FastAPI dependency.

One dependency, not one per object: FastAPI resolves each dependency on every request (a
call through its dependency machinery each), and ``POST /v1/plan`` is the route schedulers call
in a loop. Tests fake
the GPU boundary by passing an ``Nvml`` over a fake pynvml to ``create_app``, not by overriding
dependencies.

Example::

    @router.get("")
    def list_profiles(state: StateDep) -> ProfileList:
        return ... state.store.list_profiles() ...
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import Depends, Request

from autobatch.store import ProfileStore
from service.devices.gpus import GpuMonitor
from service.fleet.central import CentralProfiles
from service.probes.runs import ProbeRuns
from service.web.metrics import Metrics
from service.web.settings import Settings
from service.web.store_calls import StoreCalls

__all__ = ["ServiceState", "StateDep", "get_state", "service_state"]


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceState:
    """Everything a route may use; built once by ``create_app``, kept on ``app.state.service``."""

    settings: Settings
    store: ProfileStore
    gpus: GpuMonitor
    """NVML, read off the event loop with a timeout (``service.devices.gpus``)."""
    runs: ProbeRuns
    metrics: Metrics
    store_calls: StoreCalls
    """The store's own threads, each call under ``store_timeout_seconds``
    (``service.web.store_calls``)."""
    page_calls: StoreCalls
    """One thread for the pages of whole profiles (``GET /v1/profiles``), the costliest answer
    a read token may ask for: one page is read and encoded at a time, so however many are asked
    at once, the event loop (``/healthz``) and the other store calls share the interpreter with
    one of them only; the others wait their turn within the store deadline."""
    central: CentralProfiles | None = None
    """Node mode: the central service a plan here falls back to for a model this node's store
    does not hold (``service.fleet.central``); None without ``AUTOBATCH_CENTRAL_URL``."""


def service_state(request: Request) -> ServiceState:
    """The app's :class:`ServiceState`, for a hot route that takes the ``Request`` instead of
    :data:`StateDep` (``POST /v1/plan``: a dependency is resolved on every request, and this
    route's own work is small beside it)."""
    state: ServiceState = request.app.state.service
    return state


async def get_state(request: Request) -> ServiceState:
    """The app's :class:`ServiceState` (async: a sync dependency costs a thread-pool hop)."""
    return service_state(request)


StateDep = Annotated[ServiceState, Depends(get_state)]
