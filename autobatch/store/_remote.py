"""Where profiles come from and go to beyond the local store: the :class:`ProfileRemote` protocol.

The store layer asks a remote for profiles of a step measured on other cards (to predict a plan
for this card, :mod:`autobatch.tuning._confirmation`) and hands it every newly measured profile
(:func:`autobatch.tuning._cache.agreed_profile`). It never knows how: the road
(:mod:`autobatch.tuning`) builds the remote and passes it down, e.g. the central autobatch
service over HTTP (:class:`autobatch.client.ServiceProfiles`, built from ``report_to``). Neither
method raises: without the remote, a card is probed as usual and the profile stays local.

Example::

    class Shelf:                      # profiles kept in memory, e.g. in a test
        def __init__(self) -> None:
            self.kept: list[Profile] = []
        def profiles_of(self, identity):
            return [(str(i), p) for i, p in enumerate(self.kept)
                    if p.identity.model_fingerprint == identity.model_fingerprint], ""
        def report(self, profile):
            self.kept.append(profile)
            return ""
"""

from __future__ import annotations

from typing import Protocol

from autobatch.profile import Profile, StepIdentity

__all__ = ["ProfileRemote"]


class ProfileRemote(Protocol):
    """Profiles beyond the local store: a source of profiles measured elsewhere, and a sink for
    the ones measured here."""

    def profiles_of(self, identity: StepIdentity) -> tuple[list[tuple[str, Profile]], str]:
        """Profiles of the model of ``identity`` (its ``model_fingerprint``), newest first.

        Args:
            identity: the step a plan is wanted for; profiles of other steps of the same model
                may come back (the caller compares identities).

        Returns:
            ``(id, profile)`` pairs (ids unique across the local store and this remote), and
            ``""``; or ``[]`` and why the remote could not be asked (never raises).
        """
        ...

    def report(self, profile: Profile) -> str:
        """Hand over a newly measured profile (under torch.distributed, rank 0 only calls this).

        Returns:
            ``""`` when the remote took it, else a warning that says what failed and how to send
            it later (never raises: the profile is in hand and in the local store).
        """
        ...
