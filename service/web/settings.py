"""Server settings from ``AUTOBATCH_*`` environment variables (pydantic-settings); flags override.

Example::

    AUTOBATCH_API_TOKENS_FILE=/etc/autobatch/tokens python -m service --host 0.0.0.0
    Settings(port=9000).host     # '127.0.0.1' unless AUTOBATCH_HOST says otherwise
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["SECRET_FIELDS", "Settings", "add_serve_arguments", "settings_from_args"]

SECRET_FIELDS = frozenset({"api_token", "central_api_token"})
"""Fields whose values are never shown, not even in an error about them."""


class Settings(BaseSettings):
    """Everything the service is configured with; each field is also ``AUTOBATCH_<NAME>``."""

    model_config = SettingsConfigDict(
        env_prefix="AUTOBATCH_", extra="ignore", frozen=True, populate_by_name=True
    )

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise (the container says 0.0.0.0)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 lets the OS choose."""
    store_path: str | None = Field(
        default=None,
        validation_alias=AliasChoices("AUTOBATCH_STORE", "AUTOBATCH_STORE_PATH"),
        repr=False,  # a PostgreSQL URL may hold a password
    )
    """The profile store: a SQLite file, ``":memory:"``, or a ``sqlite:///`` or
    ``postgresql://`` URL. Read from ``AUTOBATCH_STORE``, the variable the library and the CLI
    read too (``AUTOBATCH_STORE_PATH`` is a deprecated alias); None means the XDG cache file."""
    api_token: SecretStr | None = None
    """An ``admin`` token (``service.web.auth``): when any token is set, every ``/v1`` call needs
    ``Authorization: Bearer <token>`` of a role that allows it. Trimmed of surrounding
    whitespace; an empty token is refused (it would match a request without one): unset it to
    run without a token."""
    api_tokens_file: Path | None = None
    """Tokens with roles (``service.web.auth``): a file of lines ``ROLE[:NODE] TOKEN`` (``read``,
    ``publish:NODE``, ``admin``), or a directory of one-token files named ``admin``, ``read``,
    ``publish.NODE`` (a Kubernetes Secret mounted as files). Read again when it changes
    (``service.web.token_files``): a revoked token stops working within 5 s, without a
    restart; a file that no longer parses keeps the last good tokens (logged)."""
    kubernetes_api_url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    """Kubernetes: accept a pod's projected service-account token as ``publish`` for the node
    the pod runs on, checked with this API server's TokenReview
    (``service.web.kubernetes_tokens``); in a cluster ``https://kubernetes.default.svc``.
    None accepts configured tokens only."""
    kubernetes_service_accounts: str = ""
    """Kubernetes: the service accounts whose pods may publish, ``NAMESPACE:NAME`` separated
    by commas (e.g. ``autobatch:autobatch``); required with :attr:`kubernetes_api_url`."""
    kubernetes_audience: str = Field(default="autobatch", min_length=1, max_length=253)
    """Kubernetes: the audience a pod's token must be issued for."""
    kubernetes_review_cache_seconds: float = Field(default=30.0, ge=0, le=3600)
    """Kubernetes: how long a token's review is kept; a revoked pod token (its pod deleted)
    stops working within this many seconds."""
    kubernetes_credentials_dir: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    """Kubernetes: the service's own in-cluster ``token`` and ``ca.crt``."""
    config_file: Path | None = None
    """TOML registry of the models that probe runs may run (see ``service.probes.registry``)."""
    require_gpu: bool = False
    """``/readyz`` answers 503 while NVML lists no GPU."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Largest request body accepted, in bytes; larger ones get 413."""
    probe_timeout_seconds: float = Field(default=1800.0, gt=0, le=7 * 24 * 3600)
    """A probe run's child is killed, and the run marked failed, after this many seconds."""
    max_queued_probes: int = Field(default=8, ge=0, le=1024)
    """Probe runs that may wait per device behind the running one; one more gets 409."""
    store_timeout_seconds: float = Field(default=5.0, gt=0, le=600)
    """The longest a request waits for the profile store (a write lock held by another process,
    a slow database server); beyond it the request answers 503 ``store-busy`` and ``/readyz``
    says not ready. Store calls run off the event loop (``service.web.store_calls``)."""
    nvml_timeout_seconds: float = Field(default=2.0, gt=0, le=600)
    """The longest a request waits for NVML; beyond it a device-dependent request answers 503
    ``nvml_timeout`` (a hung driver never blocks the service)."""
    header_timeout_seconds: float = Field(default=10.0, gt=0, le=3600)
    """A request's headers must arrive within this many seconds of its first byte (of the
    connection, for the first request); else 408 and the connection is closed."""
    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """A request's body must arrive within this many seconds of its headers; else the
    connection is closed."""
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """uvicorn's log level (its ``--log-level`` choices)."""
    central_url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    """Node mode: the central service (e.g. ``http://autobatch-central:8000``) that every
    profile a probe run finds is published to (``service.fleet.publisher``); None publishes
    nothing."""
    central_api_token: SecretStr | None = None
    """The central service's bearer token, when it sets one (a node's: ``publish`` as this
    node); trimmed of surrounding whitespace."""
    central_api_token_file: Path | None = None
    """A file holding :attr:`central_api_token` (a mounted Secret, or a pod's projected
    service-account token); read at start and again for each request, as a projected token
    rotates."""
    central_deletions_interval_seconds: float = Field(default=10.0, gt=0, le=3600)
    """Node mode: seconds between two looks at the central service's deleted profiles; the
    node deletes its copies of them (``service.fleet.forgetting``), so a deletion at central
    leaves the node within this plus 2 s (12 s by default)."""
    outbox_max_rows: int = Field(default=10_000, ge=1, le=10_000_000)
    """Node mode: profiles the outbox holds at most; beyond it the oldest are dropped (logged,
    counted). Each waits until the central service acknowledges it (``service.fleet.publisher``)."""
    outbox_base_delay_seconds: float = Field(default=1.0, gt=0, le=3600)
    """Node mode: the first wait's upper bound after a failed publish, seconds; it doubles."""
    outbox_max_delay_seconds: float = Field(default=60.0, gt=0, le=24 * 3600)
    """Node mode: the longest jittered wait between publishes, seconds (a ``Retry-After`` may
    ask for longer)."""

    @field_validator("api_token")
    @classmethod
    def _token_not_empty(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value().strip():
            raise ValueError(
                "the API token is empty, which would let requests without one through: set a "
                "token, or unset AUTOBATCH_API_TOKEN / drop --api-token to run without one"
            )
        return None if token is None else SecretStr(token.get_secret_value().strip())

    @field_validator("central_api_token")
    @classmethod
    def _trimmed(cls, token: SecretStr | None) -> SecretStr | None:
        text = None if token is None else token.get_secret_value().strip()
        return SecretStr(text) if text else None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`Settings` field (``--store-path``...); unset flags fall back to
    ``AUTOBATCH_*`` and then to the defaults."""
    parser.add_argument("--host", help="interface to bind")
    parser.add_argument("--port", type=int, help="TCP port (0: the OS chooses)")
    parser.add_argument(
        "--store-path",
        help="profile store: a file, ':memory:' or a postgresql:// URL",
    )
    parser.add_argument(
        "--api-token",
        help="bearer token for /v1 (prefer AUTOBATCH_API_TOKEN: flags show in `ps`)",
    )
    parser.add_argument(
        "--api-tokens-file",
        type=Path,
        help="tokens with roles: a file of lines ROLE[:NODE] TOKEN, or a Secret's directory",
    )
    parser.add_argument(
        "--kubernetes-api-url",
        help="accept pods' service-account tokens, reviewed by this Kubernetes API server",
    )
    parser.add_argument(
        "--kubernetes-service-accounts",
        help="NAMESPACE:NAME,... whose pods may publish (with --kubernetes-api-url)",
    )
    parser.add_argument("--kubernetes-audience", help="the pod tokens' audience")
    parser.add_argument(
        "--kubernetes-review-cache-seconds", type=float, help="how long a review is kept, seconds"
    )
    parser.add_argument(
        "--kubernetes-credentials-dir", type=Path, help="the service's own in-cluster token, CA"
    )
    parser.add_argument("--config-file", type=Path, help="TOML registry of probe-able models")
    parser.add_argument(
        "--require-gpu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="/readyz answers 503 while NVML lists no GPU",
    )
    parser.add_argument("--max-body-bytes", type=int, help="largest request body, bytes")
    parser.add_argument("--probe-timeout-seconds", type=float, help="probe run time limit, seconds")
    parser.add_argument("--max-queued-probes", type=int, help="waiting probe runs per device")
    parser.add_argument(
        "--store-timeout-seconds", type=float, help="longest wait for the profile store, seconds"
    )
    parser.add_argument("--nvml-timeout-seconds", type=float, help="longest wait for NVML, seconds")
    parser.add_argument(
        "--header-timeout-seconds", type=float, help="deadline for a request's headers, seconds"
    )
    parser.add_argument(
        "--body-timeout-seconds", type=float, help="deadline for a request's body, seconds"
    )
    parser.add_argument("--log-level", help="uvicorn log level")
    parser.add_argument(
        "--central-url",
        help="node mode: publish every probed profile to this central service's URL",
    )
    parser.add_argument(
        "--central-api-token",
        help="the central service's bearer token (prefer AUTOBATCH_CENTRAL_API_TOKEN)",
    )
    parser.add_argument(
        "--central-deletions-interval-seconds",
        type=float,
        help="node mode: seconds between looks at central's deleted profiles",
    )
    parser.add_argument("--outbox-max-rows", type=int, help="profiles waiting at most")
    parser.add_argument(
        "--outbox-base-delay-seconds", type=float, help="first publish retry bound, seconds"
    )
    parser.add_argument(
        "--outbox-max-delay-seconds", type=float, help="longest publish retry wait, seconds"
    )
    parser.add_argument(
        "--central-api-token-file", type=Path, help="a file holding the central service's token"
    )
    for action in parser._actions:
        if action.dest in Settings.model_fields:
            action.help = f"{action.help} (default: {default_words(action.dest)})"


def default_words(name: str) -> str:
    """What ``serve`` uses when neither the flag nor ``AUTOBATCH_<NAME>`` is given, in the one
    style every flag's help shows it: ``(default: 8000)``, ``(default: none)``."""
    if name == "store_path":
        return "$AUTOBATCH_STORE, else $XDG_CACHE_HOME/autobatch/profiles.sqlite3 (~/.cache)"
    default = Settings.model_fields[name].default
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == "":
        return "none"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """:class:`Settings` from parsed :func:`add_serve_arguments` flags over the environment.

    Raises:
        pydantic.ValidationError: a value is out of range.
    """
    names = Settings.model_fields
    given = {
        name: value for name, value in vars(args).items() if name in names and value is not None
    }
    return Settings(**given)
