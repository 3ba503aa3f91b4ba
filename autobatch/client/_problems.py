"""The one place where a service's error answer becomes an autobatch exception, and where a
service the client could not reach is worded (:func:`unreachable_words`).

The service answers errors as RFC 9457 problem details whose ``type`` is
``urn:autobatch:problem:<slug>``. An unknown profile becomes
:class:`~autobatch.errors.ProfileNotFoundError`; an infeasible plan
:class:`~autobatch.errors.NoFeasiblePlanError`; an unavailable store or GPU
:class:`~autobatch.errors.StoreError` or :class:`~autobatch.errors.DeviceUnavailableError`;
validation :class:`~autobatch.errors.ConfigError`; everything else (401, 409, 5xx)
:class:`~autobatch.errors.ServiceError`.

Example::

    response = httpx.post(url + "/v1/plan", json=body)
    raise_for_problem(response)      # returns on a 2xx
"""

from __future__ import annotations

import re

import httpx

from autobatch.errors import (
    ConfigError,
    DeviceUnavailableError,
    NoFeasiblePlanError,
    ProfileNotFoundError,
    ServiceError,
    StoreError,
)

__all__ = ["PROBLEM_TYPE_PREFIX", "raise_for_problem", "unreachable_words"]

PROBLEM_TYPE_PREFIX = "urn:autobatch:problem:"
"""What every problem ``type`` the service answers starts with; the rest is its slug."""


def raise_for_problem(response: httpx.Response, *, profile_id: str = "") -> None:
    """The one place where an error response becomes an autobatch exception.

    Args:
        response: the server's answer.
        profile_id: the profile the request named (for :class:`ProfileNotFoundError`); ``""``
            when it named none (a model fingerprint's newest profile).
    """
    if response.is_success:
        return
    try:
        problem = response.json()
    except ValueError:
        problem = {}
    if not isinstance(problem, dict):
        problem = {}
    slug = str(problem.get("type", "")).removeprefix(PROBLEM_TYPE_PREFIX)
    detail = str(problem.get("detail") or response.text or response.reason_phrase)
    message = f"{response.request.method} {response.request.url.path}: {detail}"
    status = response.status_code
    if slug == "unknown-profile":
        raise ProfileNotFoundError(message, profile_id=profile_id)
    if slug == "no-feasible-plan":
        raise NoFeasiblePlanError(message)
    if slug == "store-unavailable":
        raise StoreError(message)
    if slug == "device-unavailable":
        raise DeviceUnavailableError(message)
    if status in (400, 413, 415, 422) or slug == "unknown-model":
        raise ConfigError(message)
    raise ServiceError(message, status=status, problem=problem)


_ERRNO = re.compile(r"^\[Errno -?\d+\] ")
"""The ``[Errno 111] `` an OS error's text starts with: Python's spelling, not a reason."""

_NO_HOST = ("name or service not known", "nodename nor servname", "name does not resolve")


def unreachable_words(url: str, exc: httpx.HTTPError) -> str:
    """Why the service at ``url`` could not be reached, in words, for every surface (the
    client, ``--service``, ``--report-to``, ``report_to=``): ``could not connect to
    http://127.0.0.1:8000: connection refused (is the service running?)``; never the OS's
    ``[Errno 111]`` nor the exception's repr.

    Args:
        url: the service's URL as the caller gave it.
        exc: what httpx raised instead of an answer.
    """
    text = _ERRNO.sub("", str(exc)).strip()
    lowered = text.lower()
    if isinstance(exc, httpx.TimeoutException):
        reason = "no answer in time (is the service running, and the URL right?)"
    elif "refused" in lowered:
        reason = "connection refused (is the service running?)"
    elif any(words in lowered for words in _NO_HOST):
        reason = "no host of that name (is the URL right?)"
    else:
        reason = (text[:1].lower() + text[1:]) or type(exc).__name__
    return f"could not connect to {url}: {reason}"
