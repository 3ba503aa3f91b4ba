"""A small typed client for autobatch's HTTP service (httpx), for training scripts and schedulers.

Example::

    from autobatch.client import AutobatchClient

    with AutobatchClient("http://gpu-node:8000") as client:
        p = client.plan(profile_id=profile_id, effective_batch_size=1024, world_size=8)
"""

from __future__ import annotations

from autobatch.client._http import (
    AutobatchClient,
    PlanQuery,
    ProbeStatus,
    ServiceError,
)
from autobatch.client._publish import (
    RETRIED_STATUSES,
    RetryPolicy,
    publish_profile,
    report_profile,
    retry_after_seconds,
)
from autobatch.client._remote import ServiceProfiles, service_remote

__all__ = [
    "RETRIED_STATUSES",
    "AutobatchClient",
    "PlanQuery",
    "ProbeStatus",
    "RetryPolicy",
    "ServiceError",
    "ServiceProfiles",
    "publish_profile",
    "report_profile",
    "retry_after_seconds",
    "service_remote",
]
