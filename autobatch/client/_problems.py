"""The one place where a service's error answer becomes an autobatch exception.

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

import httpx

from autobatch.errors import (
    ConfigError,
    DeviceUnavailableError,
    NoFeasiblePlanError,
    ProfileNotFoundError,
    ServiceError,
    StoreError,
)

__all__ = ["PROBLEM_TYPE_PREFIX", "raise_for_problem"]

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
