"""FastAPI dependencies as ``Annotated`` aliases; tests swap them via ``app.dependency_overrides``.

All are ``async def``: they only read app state, and a sync dependency would cost a thread-pool
hop each (about a millisecond per request on 2 cores).

Example::

    app.dependency_overrides[get_device_lister] = lambda: Nvml(FakePynvml([...])).list_gpus

    @router.get("")
    def list_profiles(store: StoreDep) -> ...: ...
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from autobatch.device import GpuInfo
from autobatch.store import ProfileStore
from service.jobs import JobManager
from service.metrics import Metrics
from service.problems import Problem
from service.settings import Settings

__all__ = [
    "DeviceLister",
    "DeviceListerDep",
    "JobsDep",
    "MetricsDep",
    "SettingsDep",
    "StoreDep",
    "get_device_lister",
    "get_jobs",
    "get_metrics",
    "get_settings",
    "get_store",
    "require_json",
    "require_token",
]

DeviceLister = Callable[[], list[GpuInfo]]
"""NVML's GPU list (``Nvml.list_gpus``); raises ``DeviceUnavailableError`` without NVML."""


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_store(request: Request) -> ProfileStore:
    store: ProfileStore = request.app.state.store
    return store


async def get_device_lister(request: Request) -> DeviceLister:
    lister: DeviceLister = request.app.state.list_gpus
    return lister


async def get_jobs(request: Request) -> JobManager:
    jobs: JobManager = request.app.state.jobs
    return jobs


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[ProfileStore, Depends(get_store)]
DeviceListerDep = Annotated[DeviceLister, Depends(get_device_lister)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


async def require_token(request: Request) -> None:
    """401 unless ``Authorization: Bearer <token>`` matches ``settings.api_token`` (compared in
    constant time). Reads the header itself, without sub-dependencies, to keep ``/v1/plan``
    cheap; the OpenAPI security scheme is declared in ``service.problems.install_openapi``."""
    settings: Settings = request.app.state.settings
    if settings.api_token is None:
        return
    expected = settings.api_token.get_secret_value().encode()
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = ""
    if not secrets.compare_digest(given.strip().encode("utf-8", "replace"), expected):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_json(request: Request) -> None:
    """415 unless the request says its body is JSON (``application/json`` or ``*/*+json``).

    Runs before the body is validated, so a body sent as text or form data gets this clear
    answer rather than a type error.
    """
    content_type = request.headers.get("content-type")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    ):
        return
    given = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
    raise Problem(
        415,
        "unsupported-media-type",
        f"send the body as JSON with Content-Type: application/json ({given} given)",
        field="header.content-type",
    )
