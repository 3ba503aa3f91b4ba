"""``/v1/profile-summaries``: pages of what a listing shows of each stored profile (ids, model,
card, node, sizes, time), read from the store's columns without decoding a profile; the whole
profile is ``GET /v1/profiles/{id}``. Its own path, so that no profile id can shadow it."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter

from service.deps import StateDep
from service.problems import problem_responses
from service.routes.listing import ListingDep
from service.schemas import ProfileSummaryList, ProfileSummaryPublic

router = APIRouter(
    prefix="/v1/profile-summaries",
    tags=["profiles"],
    responses=problem_responses(401, 503),
)


@router.get(
    "",
    summary="List summaries of stored profiles, newest first",
    responses=problem_responses(404, 422),
)
def list_summaries(state: StateDep, listing: ListingDep) -> ProfileSummaryList:
    """One page of at most ``limit`` summaries (ids, model, card, node, sizes, time), read from
    the store's columns without decoding a profile: a few hundred bytes each, however large the
    profiles. ``next_before`` asks for the next page; ``GET /v1/profiles/{id}`` the whole one."""
    page = listing.read(state.store.list_summaries)
    return ProfileSummaryList(
        summaries=[ProfileSummaryPublic(**dataclasses.asdict(s)) for s in page.summaries],
        next_before=page.next_before,
        num_skipped=page.num_skipped,
    )
