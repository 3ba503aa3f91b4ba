"""Assembles the app: state, middleware, routers, problem handlers. No logic of its own.

Example::

    app = create_app(Settings(store_path=":memory:"))
    run(Settings(host="0.0.0.0", port=8000))      # what `autobatch serve` calls
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from autobatch.device import Nvml, default_nvml
from autobatch.errors import ConfigError
from autobatch.store import ProfileStore
from service import health
from service.admissions import routes as admissions
from service.deps import ServiceState
from service.devices import routes as devices
from service.devices.gpus import GpuMonitor
from service.fleet.central import CentralProfiles
from service.fleet.forgetting import Forgetting
from service.fleet.publisher import OutboxPolicy, Publisher
from service.plans import routes as plans
from service.probes import routes as probes
from service.probes.registry import load_registry
from service.probes.runs import ProbeRuns
from service.profiles import deletions, summaries
from service.profiles import routes as profiles
from service.web.auth import central_token_source
from service.web.kubernetes_tokens import KubernetesSettings, TokenReviewer, service_accounts_of
from service.web.metrics import Metrics
from service.web.middleware import ServiceMiddleware
from service.web.problems import install_openapi, install_problem_handlers
from service.web.protocol import MAX_HEADER_BYTES, timed_protocol
from service.web.settings import Settings
from service.web.store_calls import StoreCalls
from service.web.token_files import TokenSource

__all__ = ["create_app", "run"]

API_VERSION = "1"
_log = logging.getLogger("service")


def create_app(settings: Settings | None = None, *, nvml: Nvml | None = None) -> FastAPI:
    """The service as an ASGI app; its shared objects are ``app.state.service`` (``ServiceState``).

    Args:
        settings: the configuration; None reads ``AUTOBATCH_*`` from the environment.
        nvml: the NVML to read GPUs with; None is the process's (``default_nvml()``). Tests
            pass ``Nvml(FakePynvml(...))``.

    Raises:
        ConfigError: the model registry file is unreadable or invalid; the API tokens file
            (or the central token's file) is unreadable or invalid (``service.web.auth``).
        StoreError: the profile store cannot be opened.
    """
    settings = settings or Settings()
    registry = load_registry(settings.config_file)
    api_token = settings.api_token
    tokens = TokenSource(
        api_token=None if api_token is None else api_token.get_secret_value(),
        tokens_file=settings.api_tokens_file,
    )
    # The database gives up on a statement or lock at the same deadline as the request; a
    # replica whose database is away starts anyway, not ready until it answers.
    store = ProfileStore(
        settings.store_path, timeout_seconds=settings.store_timeout_seconds, open_later=True
    )
    metrics = Metrics()
    central, publisher, forgetting = _fleet(settings, store, metrics)
    runs = ProbeRuns(
        registry,
        store,
        timeout_seconds=settings.probe_timeout_seconds,
        max_queued=settings.max_queued_probes,
        on_event=metrics.probe_event,
        on_profile=None if publisher is None else publisher.submit,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runs.open()
        if publisher is not None:
            publisher.open()  # resumes what the outbox holds
        if forgetting is not None:
            forgetting.open()  # deletes here what central deleted
        yield
        runs.close()  # kills running probe children; the store stays open for run()/the caller
        store_calls.close()
        page_calls.close()
        if publisher is not None:
            publisher.close()  # what waits stays in the outbox
        if forgetting is not None:
            forgetting.close()

    store_calls = StoreCalls(timeout_seconds=settings.store_timeout_seconds)
    page_calls = StoreCalls(timeout_seconds=settings.store_timeout_seconds, max_threads=1)
    app = FastAPI(
        title="autobatch",
        version=API_VERSION,
        description="Micro-batch and accumulation plans, profiles, probe runs and GPU inventory.",
        lifespan=lifespan,
    )
    app.state.service = ServiceState(
        settings=settings,
        store=store,
        gpus=GpuMonitor(nvml or default_nvml(), timeout_s=settings.nvml_timeout_seconds),
        runs=runs,
        metrics=metrics,
        store_calls=store_calls,
        page_calls=page_calls,
        central=central,
    )
    app.add_middleware(
        ServiceMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        tokens=tokens,
        reviewer=_reviewer(settings),
    )
    for module in (plans, admissions, profiles, summaries, deletions, probes, devices, health):
        app.include_router(module.router)
    install_problem_handlers(app, feature_errors=probes.PROBE_RUN_ERRORS)
    install_openapi(app)
    return app


def _fleet(
    settings: Settings, store: ProfileStore, metrics: Metrics
) -> tuple[CentralProfiles | None, Publisher | None, Forgetting | None]:
    """Node mode (``central_url`` set): the read-through to the central service, the outbox's
    publisher and the follower of its deletions; three None without it.

    Raises:
        ConfigError: the central token's file is unreadable or holds no single token.
    """
    if not settings.central_url:
        return None, None, None
    central_token = central_token_source(settings)
    central = CentralProfiles(settings.central_url, token=central_token)
    publisher = Publisher(
        settings.central_url,
        token=central_token,
        store=store,
        policy=OutboxPolicy(
            base_delay_seconds=settings.outbox_base_delay_seconds,
            max_delay_seconds=settings.outbox_max_delay_seconds,
            max_rows=settings.outbox_max_rows,
        ),
        metrics=metrics,
    )
    forgetting = Forgetting(
        central, store, interval_seconds=settings.central_deletions_interval_seconds
    )
    return central, publisher, forgetting


def _reviewer(settings: Settings) -> TokenReviewer | None:
    """The Kubernetes reviewer of pods' tokens, when ``kubernetes_api_url`` is set.

    Raises:
        ConfigError: ``kubernetes_service_accounts`` names none, or one that is not
            ``NAMESPACE:NAME``.
    """
    if settings.kubernetes_api_url is None:
        return None
    return TokenReviewer(
        KubernetesSettings(
            api_url=settings.kubernetes_api_url,
            service_accounts=service_accounts_of(settings.kubernetes_service_accounts),
            audience=settings.kubernetes_audience,
            credentials_dir=settings.kubernetes_credentials_dir,
            cache_seconds=settings.kubernetes_review_cache_seconds,
        )
    )


def check_bindable(host: str, port: int) -> None:
    """Refuse a port another process holds before the app starts, so ``serve`` says so in one
    line instead of logging a startup and then uvicorn's bind error. Port 0 (the OS chooses)
    always binds.

    Raises:
        ConfigError: ``port`` on ``host`` is in use, or ``host`` is no address of this machine.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"host {host!r} does not resolve ({exc.strerror}); give --host an address of this "
            "machine, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"port {port} on {host} is in use: choose another with --port (or stop "
                    "the process that holds it)"
                ) from None
            raise ConfigError(
                f"cannot bind port {port} on {host} ({exc.strerror}): choose another --port "
                "or --host"
            ) from None


def run(settings: Settings) -> None:
    """Serve until interrupted (``uvicorn.run`` on ``settings.host``/``settings.port``).

    Raises:
        ConfigError: the port cannot be bound (in use, or a host this machine does not have),
            found before anything starts.
    """
    check_bindable(settings.host, settings.port)
    app = create_app(settings)
    tokenless = (
        settings.api_token is None
        and settings.api_tokens_file is None
        and settings.kubernetes_api_url is None
    )
    if tokenless and settings.host not in ("127.0.0.1", "localhost", "::1"):
        _log.warning(
            "serving on %s without an API token: anyone who can reach the port can register "
            "and delete profiles and start probe runs; set AUTOBATCH_API_TOKEN",
            settings.host,
        )
    try:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            timeout_graceful_shutdown=10,
            http=timed_protocol(
                header_timeout_s=settings.header_timeout_seconds,
                body_timeout_s=settings.body_timeout_seconds,
            ),
            # the protocol above caps a request's headers; the same cap should h11 ever serve
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
    finally:
        app.state.service.store.close()
