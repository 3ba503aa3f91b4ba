"""Publishing a profile to a (central) autobatch service, with retries.

A sidecar that finishes a probe, or ``autobatch tune --report-to URL``, POSTs the profile to the
central service's ``/v1/profiles``. The network between a node and the central Service drops
requests (a replica restarting, a rolling update, a load balancer's 502/503), so a publish is
retried: at most :attr:`RetryPolicy.max_attempts` tries and :attr:`RetryPolicy.max_seconds` in
all, waiting between them an exponentially growing delay with "full jitter" (a uniform draw in
``[0, min(max_delay, base_delay * 2**attempt)]``; AWS Architecture Blog, "Exponential Backoff
And Jitter", 2015), or the server's ``Retry-After`` when it sends one (RFC 9110 §10.2.3). The
default's waits are drawn under 2, 4, 8, 16 and 30 s: its 6 tries spread over up to 60 s (30 s
on average), never past :attr:`RetryPolicy.max_seconds`. A node's sidecar does not use this
bounded retry: its outbox sends each profile until it is acknowledged (``service.fleet.publisher``).

Retried: a connection or timeout error, 408, 425, 429 and any 5xx. Not retried: every other
answer (a 422 says the profile is invalid and will be every time; a 401 the token is wrong).
The same bytes are sent on every try, and the store makes a re-put of the same profile a no-op
(its id is the hash of its content), so a try that reached the server but whose answer was lost
does no harm when repeated.

Example::

    profile_id = publish_profile("http://autobatch-central:8000", profile,
                                 token=os.environ.get("AUTOBATCH_API_TOKEN"))
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable

import httpx

from autobatch.client._auth import bearer_headers
from autobatch.client._problems import raise_for_problem, unreachable_words
from autobatch.errors import ConfigError, ServiceError
from autobatch.profile import Profile

__all__ = [
    "RETRIED_STATUSES",
    "RetryPolicy",
    "publish_profile",
    "report_profile",
    "retry_after_seconds",
]

RETRIED_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
"""Answers that may succeed when asked again (and any other 5xx)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How hard a publish tries (module docstring)."""

    max_attempts: int = 6
    """Tries in all, >= 1."""
    max_seconds: float = 60.0
    """No try starts after this many seconds from the first, > 0."""
    base_delay_seconds: float = 2.0
    """The first wait's upper bound, seconds, > 0; it doubles per try."""
    max_delay_seconds: float = 30.0
    """No wait is longer than this, seconds (a ``Retry-After`` included)."""
    timeout_seconds: float = 10.0
    """Each try's own timeout, seconds."""

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or self.max_attempts < 1:
            raise ConfigError(f"max_attempts {self.max_attempts!r} must be an int >= 1")
        for name in ("max_seconds", "base_delay_seconds", "max_delay_seconds", "timeout_seconds"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} {value!r} must be a number of seconds > 0")

    def delay_seconds(self, attempt: int, draw: float) -> float:
        """The wait after try ``attempt`` (0-based), with ``draw`` uniform in [0, 1)."""
        return draw * min(self.max_delay_seconds, self.base_delay_seconds * 2.0**attempt)


def publish_profile(
    url: str,
    profile: Profile,
    *,
    token: str | None = None,
    policy: RetryPolicy | None = None,
    transport: httpx.BaseTransport | None = None,
    sleep: Callable[[float], None] = time.sleep,
    draw: Callable[[], float] = random.random,
) -> str:
    """POST ``profile`` to ``url``'s ``/v1/profiles``, retried (module docstring).

    Args:
        url: the service's base URL, e.g. ``"http://autobatch-central:8000"``.
        profile: what to publish.
        token: bearer token, or None (trimmed of surrounding whitespace).
        policy: how hard to try; default :class:`RetryPolicy()`.
        transport: an httpx transport (tests).
        sleep: waits between tries (tests pass a recorder).
        draw: the jitter's uniform draw in [0, 1).

    Returns:
        The profile's id on the server (the same for every publish of the same profile).

    Raises:
        ConfigError: the server refused the profile (422, 400...): retrying cannot help; or
            ``token`` holds a character a header cannot carry (the token is not shown).
        ServiceError: every try failed (the last failure's message, and how many tries), or an
            answer that is not retried (401, 403, 404...).
    """
    policy = policy or RetryPolicy()
    body = json.dumps(profile.to_dict(), separators=(",", ":")).encode()
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json",
        **bearer_headers(token),
    }
    start = time.monotonic()
    failure = ""
    with httpx.Client(
        base_url=url, headers=headers, timeout=policy.timeout_seconds, transport=transport
    ) as http:
        for attempt in range(policy.max_attempts):
            retry_after = None
            try:
                response = http.post("/v1/profiles", content=body)
            except httpx.HTTPError as exc:
                failure = unreachable_words(url.rstrip("/"), exc)
            else:
                if response.is_success:
                    return str(response.json()["id"])
                status = response.status_code
                if status not in RETRIED_STATUSES and status < 500:
                    raise_for_problem(response)
                failure = f"answered {status} {response.reason_phrase}: {response.text[:200]}"
                retry_after = retry_after_seconds(response)
            if attempt + 1 == policy.max_attempts:
                break
            wait = policy.delay_seconds(attempt, draw())
            if retry_after is not None:
                wait = min(retry_after, policy.max_delay_seconds)
            if time.monotonic() - start + wait > policy.max_seconds:
                break
            sleep(wait)
    raise ServiceError(
        f"POST {url}/v1/profiles: gave up after {attempt + 1} tries in "
        f"{time.monotonic() - start:.1f} s (retry policy: at most {policy.max_attempts} tries, "
        f"{policy.max_seconds:g} s); last: {failure}",
        status=0,
    )


def retry_after_seconds(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (the delay-seconds form); None when absent or a date."""
    value = response.headers.get("Retry-After", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def report_profile(
    url: str,
    profile: Profile,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    transport: httpx.BaseTransport | None = None,
) -> str:
    """Publish ``profile`` to the service at ``url`` (``autotune(..., report_to=url)``), retried
    a few times (at most 4 tries in 10 s: a training script does not wait long for a
    scheduler's service; :func:`autobatch.client.publish_profile` tries harder).

    Args:
        url: the service's base URL.
        profile: what to register.
        token: bearer token; None reads nothing (pass ``os.environ.get("AUTOBATCH_API_TOKEN")``).
        timeout: seconds per try.
        transport: an httpx transport (tests).

    Returns:
        The profile's id on the server.

    Raises:
        ConfigError: the server rejected the profile. ServiceError: unreachable, 401, 5xx.
    """
    policy = RetryPolicy(
        max_attempts=4,
        max_seconds=10.0,
        base_delay_seconds=0.5,
        max_delay_seconds=4.0,
        timeout_seconds=timeout,
    )
    return publish_profile(url, profile, token=token, policy=policy, transport=transport)
