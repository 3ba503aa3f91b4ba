"""``/v1/profiles``: register, list, read and delete stored profiles."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from autobatch.errors import ProfileNotFoundError
from autobatch.profile import Profile
from service.auth import GRANT_SCOPE_KEY, Grant
from service.deps import StateDep
from service.problems import Problem, problem_responses, unknown_profile
from service.routes.listing import ListingDep
from service.routing import JsonBodyRoute
from service.schemas import (
    ProfileBase,
    ProfileCreate,
    ProfileList,
    ProfilePublic,
)

router = APIRouter(
    prefix="/v1/profiles",
    route_class=JsonBodyRoute,
    tags=["profiles"],
    responses=problem_responses(401, 403, 503),
)


PAGE_BYTES = 8 << 20
"""A listing page ends once its profiles hold this many bytes of stored JSON (one at least)."""


def profile_public(profile_id: str, profile: Profile) -> ProfilePublic:
    return ProfilePublic(
        id=profile_id, profile=ProfileBase.model_validate(profile.to_dict(), strict=False)
    )


@router.post(
    "",
    status_code=201,
    summary="Register a profile (e.g. from autotune)",
    responses=problem_responses(400, 413, 415, 422),
)
def create_profile(
    body: ProfileCreate, state: StateDep, request: Request, response: Response
) -> ProfilePublic:
    """Stores the profile under a new id (the ``Location`` header names it). A node's token
    (``publish`` as a node) stores only profiles of that node: 403 for another's."""
    grant: Grant | None = request.scope.get(GRANT_SCOPE_KEY)
    if grant is not None and grant.node is not None and body.node_name != grant.node:
        raise Problem(
            403,
            "wrong-node",
            f"this token publishes as node {grant.node!r} only, and the profile's node_name "
            f"is {body.node_name!r}: a node publishes its own profiles (use that node's token)",
            field="body.node_name",
        )
    profile = Profile.from_dict(body.model_dump())
    if not profile.created_at:  # the time it reached the service, as a probe would stamp it
        profile = dataclasses.replace(profile, created_at=datetime.now(UTC).isoformat())
    profile_id = state.store.put(profile)
    response.headers["Location"] = f"/v1/profiles/{profile_id}"
    return profile_public(profile_id, profile)


FollowCursor = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,18}$",
        description="Follow the store: profiles stored after this cursor, oldest first ('0' "
        "from the first); each page's next_after is the next cursor. Misses none on either "
        "backend (the cursor follows commit order). Not with before.",
    ),
]


@router.get("", summary="List stored profiles, newest first", responses=problem_responses(404, 422))
def list_profiles(state: StateDep, listing: ListingDep, after: FollowCursor = None) -> ProfileList:
    """One page of at most ``limit`` profiles and about 8 MiB (``PAGE_BYTES``): memory per
    request stays bounded however large the profiles. ``next_before`` asks for the next page;
    with ``after``, ``next_after`` does (oldest first)."""
    cursor = None if after is None else int(after)
    page = listing.read(state.store.page_profiles, max_bytes=PAGE_BYTES, after=cursor)
    return ProfileList(
        profiles=[profile_public(pid, profile) for pid, profile in page.profiles],
        next_before=page.next_before,
        next_after=None if page.next_after is None else str(page.next_after),
    )


@router.get("/{profile_id}", summary="Read a profile", responses=problem_responses(404, 422))
def get_profile(profile_id: str, state: StateDep) -> ProfilePublic:
    try:
        return profile_public(profile_id, state.store.get(profile_id))
    except ProfileNotFoundError:
        raise unknown_profile(profile_id, field="path.profile_id") from None


@router.delete(
    "/{profile_id}",
    status_code=204,
    summary="Delete a profile",
    response_class=Response,
    responses=problem_responses(404, 422),
)
def delete_profile(profile_id: str, state: StateDep) -> Response:
    if not state.store.delete(profile_id):
        raise unknown_profile(profile_id, field="path.profile_id")
    return Response(status_code=204)
