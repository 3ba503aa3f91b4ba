"""``/v1/profile-summaries``: pages of what a listing shows of each stored profile (ids, model,
card, node, sizes, time), read from the store's columns without decoding a profile; the whole
profile is ``GET /v1/profiles/{id}``. Its own path, so that no profile id can shadow it."""

from __future__ import annotations

import dataclasses
import json

from fastapi import APIRouter, Response

from service.deps import StateDep
from service.profiles.listing import ListingDep
from service.profiles.routes import json_response
from service.web.problems import problem_responses
from service.web.schemas import ProfileSummaryList, ProfileSummaryPublic
from service.web.store_calls import store_call

router = APIRouter(
    prefix="/v1/profile-summaries",
    tags=["profiles"],
    responses=problem_responses(401, 503),
)


@router.get(
    "",
    summary="List summaries of stored profiles, newest first",
    response_model=ProfileSummaryList,
    responses=problem_responses(404, 422),
)
async def list_summaries(state: StateDep, listing: ListingDep) -> Response:
    """One page of at most ``limit`` summaries (ids, model, card, node, sizes, time), read from
    the store's columns without decoding a profile: a few hundred bytes each, however large the
    profiles. ``next_before`` asks for the next page; ``GET /v1/profiles/{id}`` the whole one.
    Read on the store's threads under the store deadline (``service.web.store_calls``)."""

    def page() -> Response:
        found = listing.read(state.store.list_summaries)
        return json_response(
            ProfileSummaryList(
                summaries=[
                    # the key is stored as its canonical JSON text; the answer is an object
                    ProfileSummaryPublic(
                        **{**dataclasses.asdict(s), "cache_key": json.loads(s.cache_key)}
                    )
                    for s in found.summaries
                ],
                next_before=found.next_before,
                num_skipped=found.num_skipped,
            )
        )

    return await store_call(state, page)
