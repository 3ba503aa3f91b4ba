"""A node sidecar's read-through to the central service: a profile another node measured
answers here too.

A node's sidecar keeps its own store, and publishes what it measures to the central service
(:mod:`service.fleet.publisher`). When a plan here names a model the node's store does not hold, and
``AUTOBATCH_CENTRAL_URL`` is set, the sidecar asks the central service which profile of that
model answers for this card (``POST /v1/plan`` with ``card``: its selection rule, measured or
predicted), reads that profile (``GET /v1/profiles/{id}``), keeps a copy in its own store and
plans from it. The copy keeps its node name, so a plan from it still says where it was measured.

A central service that does not answer in ``timeout_seconds`` (or answers a problem) is not an
error here: the sidecar answers from what it holds, as it would without a central service.
Called in the store's worker thread (``service.web.store_calls``), never on the event loop.

Example::

    central = CentralProfiles("http://autobatch-central:8000", token=None)
    found = central.fetch("9f2c...", card="NVIDIA H100 80GB HBM3")   # (id, Profile) or None
"""

from __future__ import annotations

import logging

from autobatch.client import AutobatchClient, PlanQuery
from autobatch.errors import AutobatchError, ProfileNotFoundError
from autobatch.planning import PlanRequest
from autobatch.profile import Profile

__all__ = ["CentralProfiles"]

_log = logging.getLogger("service.fleet.central")


class CentralProfiles:
    """Reads profiles from the central service at ``url``.

    Args:
        url: the central service's base URL.
        token: its bearer token, or None.
        timeout_seconds: the longest each of the two requests may take, in seconds.
    """

    def __init__(self, url: str, *, token: str | None, timeout_seconds: float = 2.0) -> None:
        self.url = url
        self._token = token
        self._timeout_seconds = timeout_seconds

    def fetch(self, model_fingerprint: str, *, card: str | None) -> tuple[str, Profile] | None:
        """The central service's profile of ``model_fingerprint`` for ``card`` (any card when
        None): ``(profile_id, profile)``, or None when it holds none or cannot be reached."""
        query = PlanQuery(
            plan=PlanRequest(effective_batch_size=1), model_fingerprint=model_fingerprint, card=card
        )
        try:
            with AutobatchClient(
                self.url, token=self._token, timeout=self._timeout_seconds
            ) as client:
                answer = client.plan_answer(query)
                profile_id = answer.get("profile_id")
                if not isinstance(profile_id, str):
                    return None
                return profile_id, client.get_profile(profile_id)
        except ProfileNotFoundError:
            return None
        except AutobatchError as exc:
            _log.warning(
                "the central service %s gave no profile of %s: %s", self.url, model_fingerprint, exc
            )
            return None
