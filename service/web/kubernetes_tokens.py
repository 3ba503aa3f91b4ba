"""A pod's own identity: its projected service-account token, checked by the cluster's
TokenReview API, publishes as the node the pod runs on and no other.

A DaemonSet pod (``deploy/daemonset.yaml``) mounts a ``serviceAccountToken`` projected volume
(audience ``autobatch``, expiring, rotated by the kubelet) and sends it as its bearer token. The
service (``AUTOBATCH_KUBERNETES_API_URL`` set, in-cluster ``https://kubernetes.default.svc``)
posts it to ``/apis/authentication.k8s.io/v1/tokenreviews`` with its own in-cluster credentials
(the token and CA the kubelet mounts at ``/var/run/secrets/kubernetes.io/serviceaccount``; its
service account needs ``create`` on ``tokenreviews``: ``system:auth-delegator``). A token is a
``publish`` grant when the review says

- ``authenticated``, for an audience that includes :attr:`KubernetesSettings.audience`;
- for a service account listed in ``AUTOBATCH_KUBERNETES_SERVICE_ACCOUNTS``
  (``NAMESPACE:NAME``), so no other pod of the cluster may publish;
- bound to a pod, with the node of that pod in the user's extra
  ``authentication.kubernetes.io/node-name`` (Kubernetes 1.30 and later); the grant's node is
  that one, so the pod publishes its own node's profiles only (403 ``wrong-node`` otherwise).

Reviews are kept :attr:`KubernetesSettings.cache_seconds` (30 s by default), accepted and refused
alike, keyed by the token's SHA-256 (never the token): a token revoked (its pod deleted) stops
working within that time. Accepted and refused reviews are kept apart, each up to
:data:`MAX_KEPT_REVIEWS` (the oldest dropped first when full): a flood of made-up tokens only
churns the refusals, and real pods' reviews stay kept. Only tokens shaped like a JWT (three
dot-separated parts) are sent; an API server that does not answer within ``timeout_seconds`` is
:class:`ReviewUnavailable` (503 with ``Retry-After``: the node's outbox retries), and so is a
review asked while :data:`MAX_REVIEWS_IN_FLIGHT` others wait, so that a flood of made-up tokens
costs the API server at most that many requests at a time.

Example::

    reviewer = TokenReviewer(KubernetesSettings(api_url="https://kubernetes.default.svc",
                                                service_accounts=frozenset({"autobatch:autobatch"})))
    grant = await reviewer.review(b"eyJhbGciOi...")   # Grant(role='publish', node='gpu-node-7')
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from autobatch.errors import AutobatchError, ConfigError
from service.web.auth import Grant

__all__ = [
    "MAX_KEPT_REVIEWS",
    "MAX_REVIEWS_IN_FLIGHT",
    "NODE_NAME_EXTRA",
    "SERVICE_ACCOUNT_DIR",
    "KubernetesSettings",
    "ReviewUnavailable",
    "TokenReviewer",
    "service_accounts_of",
]

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
"""The TokenReview user's extra that names the node of the pod a token is bound to."""
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's own service-account token and the cluster's CA."""
MAX_REVIEWS_IN_FLIGHT = 8
"""Reviews one service waits on at once; one more is refused (503) at once."""
_REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
MAX_KEPT_REVIEWS = 10_000
"""Reviews kept at most, accepted and refused each; the oldest goes first when full."""
_log = logging.getLogger("service.auth")


class ReviewUnavailable(AutobatchError):
    """The API server did not review a token (unreachable, slow, or an answer not a review)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KubernetesSettings:
    """Where and how tokens are reviewed (``service.web.settings``' ``kubernetes_*``)."""

    api_url: str
    """The API server, e.g. ``https://kubernetes.default.svc``."""
    service_accounts: frozenset[str]
    """``NAMESPACE:NAME`` of the service accounts whose pods may publish."""
    audience: str = "autobatch"
    """The audience a token must be issued for (the projected volume's ``audience``)."""
    credentials_dir: Path = SERVICE_ACCOUNT_DIR
    """The service's own ``token`` (read again for each review: it rotates) and ``ca.crt``."""
    cache_seconds: float = 30.0
    """How long a review is kept, in seconds."""
    timeout_seconds: float = 2.0
    """The longest a review may take, in seconds."""


class TokenReviewer:
    """Reviews pods' tokens with the API server; see the module docstring.

    Args:
        settings: the API server and what a token must carry.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self, settings: KubernetesSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._accepted = _KeptReviews(MAX_KEPT_REVIEWS)
        self._refused = _KeptReviews(MAX_KEPT_REVIEWS)
        self._in_flight = 0

    async def review(self, token: bytes) -> Grant | None:
        """The ``publish`` grant of a pod's ``token``; None when it is not one (not a JWT, not
        authenticated, another audience or service account, no node).

        Raises:
            ReviewUnavailable: the API server did not answer a review in time, or
                :data:`MAX_REVIEWS_IN_FLIGHT` reviews wait on it already.
        """
        if token.count(b".") != 2:
            return None
        key = hashlib.sha256(token).hexdigest()
        now = self._clock()
        for kept in (self._accepted, self._refused):
            found, grant = kept.get(key, now)
            if found:
                return grant
        if self._in_flight >= MAX_REVIEWS_IN_FLIGHT:
            raise ReviewUnavailable(
                f"{MAX_REVIEWS_IN_FLIGHT} token reviews are waiting on the Kubernetes API "
                "server already; this one is refused rather than queued"
            )
        self._in_flight += 1
        try:
            grant = self._grant(await self._post(token), token)
        finally:
            self._in_flight -= 1
        kept = self._refused if grant is None else self._accepted
        kept.put(key, grant, expires=now + self.settings.cache_seconds, now=now)
        return grant

    async def _post(self, token: bytes) -> dict[str, Any]:
        """The review's ``status``."""
        settings = self.settings
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token.decode(), "audiences": [settings.audience]},
        }
        try:
            own = (settings.credentials_dir / "token").read_text().strip()
            verify = _verify(settings)
            async with httpx.AsyncClient(
                base_url=settings.api_url, verify=verify, timeout=settings.timeout_seconds
            ) as http:
                response = await http.post(
                    _REVIEW_PATH, json=body, headers={"Authorization": f"Bearer {own}"}
                )
            response.raise_for_status()
            status = response.json()["status"]
            if not isinstance(status, dict):
                raise TypeError("status is not an object")
            return status
        except (OSError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ReviewUnavailable(
                f"the Kubernetes API server {settings.api_url} did not review a token: "
                f"{type(exc).__name__}: {str(exc)[:200]}"
            ) from None

    def _grant(self, status: dict[str, Any], token: bytes) -> Grant | None:
        user = status.get("user") or {}
        username = str(user.get("username", ""))
        audiences = status.get("audiences") or []
        if status.get("authenticated") is not True or self.settings.audience not in audiences:
            return None
        account = username.removeprefix("system:serviceaccount:")
        if account == username or account not in self.settings.service_accounts:
            _log.warning("a token of %s may not publish (not a listed service account)", username)
            return None
        nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
        if len(nodes) != 1 or not str(nodes[0]).strip():
            _log.warning(
                "a token of %s names no node (%s): it is not bound to a pod, or the cluster is "
                "older than Kubernetes 1.30",
                username,
                NODE_NAME_EXTRA,
            )
            return None
        return Grant(
            role="publish", node=str(nodes[0]), source=f"Kubernetes {username}", token=token
        )


class _KeptReviews:
    """Reviews kept until they expire, ``limit`` at most, oldest first: when full, the oldest
    goes (expired or not), so a new review is always kept. Kept for the same time each, they
    expire oldest first too: the expired ones are dropped from the front as reviews arrive."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._reviews: OrderedDict[str, tuple[float, Grant | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reviews)

    def get(self, key: str, now: float) -> tuple[bool, Grant | None]:
        """``(True, grant)`` for a review kept and not expired at ``now`` (monotonic seconds),
        else ``(False, None)``."""
        kept = self._reviews.get(key)
        if kept is None or kept[0] <= now:
            return False, None
        return True, kept[1]

    def put(self, key: str, grant: Grant | None, *, expires: float, now: float) -> None:
        """Keep ``grant`` under ``key`` until ``expires`` (monotonic seconds)."""
        self._reviews.pop(key, None)
        while self._reviews and (
            len(self._reviews) >= self._limit or next(iter(self._reviews.values()))[0] <= now
        ):
            self._reviews.popitem(last=False)
        self._reviews[key] = (expires, grant)


def _verify(settings: KubernetesSettings) -> ssl.SSLContext | bool:
    """TLS verification against the cluster's CA where it is mounted; the system's otherwise."""
    ca = settings.credentials_dir / "ca.crt"
    return ssl.create_default_context(cafile=str(ca)) if ca.is_file() else True


def service_accounts_of(text: str) -> frozenset[str]:
    """``NAMESPACE:NAME`` service accounts from a comma-separated ``text``.

    Raises:
        ConfigError: an entry is not ``NAMESPACE:NAME`` (naming it), or there is none.
    """
    accounts = [word.strip() for word in text.split(",") if word.strip()]
    for account in accounts:
        namespace, colon, name = account.partition(":")
        if not (namespace and colon and name) or ":" in name:
            raise ConfigError(
                f"AUTOBATCH_KUBERNETES_SERVICE_ACCOUNTS entry {account!r} is not NAMESPACE:NAME "
                "(e.g. autobatch:autobatch, the DaemonSet's service account)"
            )
    if not accounts:
        raise ConfigError(
            "AUTOBATCH_KUBERNETES_API_URL is set but AUTOBATCH_KUBERNETES_SERVICE_ACCOUNTS names "
            "no NAMESPACE:NAME: name the DaemonSet's service account, e.g. autobatch:autobatch"
        )
    return frozenset(accounts)
