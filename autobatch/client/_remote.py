"""The autobatch service as the store layer's remote: where ``autotune(report_to=url)`` looks for
profiles measured on other cards and sends the ones it measures.

:class:`ServiceProfiles` implements :class:`autobatch.store._remote.ProfileRemote` over HTTP
(``GET /v1/profiles``, and ``POST /v1/profiles`` through :func:`report_profile`'s short retries).
The road (:mod:`autobatch.tuning`) builds it with :func:`service_remote` and passes it down; the
store layer never imports this module.

Example::

    remote = ServiceProfiles("http://autobatch-central:8000",
                             token=os.environ.get("AUTOBATCH_API_TOKEN"))
    found, why = remote.profiles_of(profile.identity)    # [(id, profile), ...], "" when asked
    remote.report(profile)                                # "" when registered, else a warning
"""

from __future__ import annotations

import dataclasses
import os

from autobatch.client._http import AutobatchClient
from autobatch.client._publish import report_profile
from autobatch.errors import AutobatchError
from autobatch.profile import Profile, StepIdentity

__all__ = ["ServiceProfiles", "service_remote"]


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceProfiles:
    """The profiles an autobatch service holds; never raises (a failure is said, not raised)."""

    base_url: str
    """The service's base URL, e.g. ``"http://autobatch-central:8000"``."""
    token: str | None = dataclasses.field(default=None, kw_only=True, repr=False)
    """Bearer token, or None."""
    timeout_seconds: float = dataclasses.field(default=10.0, kw_only=True)
    """Each request's timeout, seconds."""

    def profiles_of(self, identity: StepIdentity) -> tuple[list[tuple[str, Profile]], str]:
        """The service's profiles of this step's model, newest first, with ids prefixed by the
        URL (apart from the local store's); ``[]`` and why when the service could not be
        asked, ``""`` otherwise."""
        url = self.base_url
        try:
            with AutobatchClient(url, token=self.token, timeout=self.timeout_seconds) as client:
                found = client.list_profiles(model_fingerprint=identity.model_fingerprint)
        except AutobatchError as exc:
            return (
                [],
                f"could not ask the autobatch service at {url} for profiles of this step: {exc}",
            )
        return [(f"{url} {profile_id}", profile) for profile_id, profile in found], ""

    def report(self, profile: Profile) -> str:
        """Register ``profile`` with the service (:func:`report_profile`: a few quick tries);
        ``""`` when it took it, else a warning naming the service and the failure (the road
        adds the fix, in each surface's words: :class:`~autobatch.errors.ReportWarning`)."""
        url = self.base_url
        try:
            report_profile(url, profile, token=self.token, timeout=self.timeout_seconds)
        except AutobatchError as exc:
            return f"could not register the profile with the autobatch service at {url}: {exc}"
        return ""


def service_remote(report_to: str | None) -> ServiceProfiles | None:
    """The service at ``report_to`` as the road's remote, with the bearer token from
    ``$AUTOBATCH_API_TOKEN``; None without a URL (the store alone)."""
    if report_to is None:
        return None
    return ServiceProfiles(report_to, token=os.environ.get("AUTOBATCH_API_TOKEN"))
