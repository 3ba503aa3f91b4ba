"""``/v1/profiles``: register, list, read and delete stored profiles.

Each route's store work runs on the store's threads under the store deadline
(``service.web.store_calls``), its answer encoded there too: a frozen database or a locked table
answers 503 ``store-busy`` in time, and never holds the event loop or the threads other routes
use."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel

from autobatch.device import NODE_NAME_ENV_VARS
from autobatch.errors import ProfileDeletedError, ProfileNotFoundError
from autobatch.planning import check_arrival, profile_report, uncatalogued_note
from autobatch.profile import Profile
from service.deps import StateDep
from service.profiles.listing import Listing, ListingDep
from service.profiles.report import ProfileReport
from service.web.auth import GRANT_SCOPE_KEY, Grant
from service.web.problems import Problem, problem_responses, unknown_profile
from service.web.routing import JsonBodyRoute
from service.web.schemas import (
    IdPath,
    ProfileCreate,
    ProfileList,
    ProfilePublic,
)
from service.web.store_calls import store_call

router = APIRouter(
    prefix="/v1/profiles",
    route_class=JsonBodyRoute,
    tags=["profiles"],
    responses=problem_responses(401, 403, 503),
)


PAGE_BYTES = 512 << 10
"""A listing page ends once its profiles hold this many bytes of stored JSON (one at least):
512 KiB, a few tens of milliseconds to read and encode, so that a page in the making never holds
the interpreter long enough to delay ``/healthz`` past its goal (``bench/healthz_under_load.py``
with ``--listings``)."""


def profile_public(profile_id: str, profile: Profile) -> ProfilePublic:
    """The profile as stored, unchecked against a request's bounds (``StoredProfile``)."""
    return ProfilePublic(id=profile_id, profile=profile.to_dict())


def json_response(
    model: BaseModel, *, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``model`` as JSON, encoded where it is built: on a store thread, so that a page of
    large profiles is never converted on the event loop."""
    return Response(
        model.model_dump_json(),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )


@router.post(
    "",
    status_code=201,
    summary="Register a profile (e.g. from autotune)",
    response_model=ProfilePublic,
    responses={
        200: {"model": ProfilePublic, "description": "Stored already: the same id"},
        **problem_responses(400, 410, 413, 415, 422),
    },
)
async def create_profile(body: ProfileCreate, state: StateDep, request: Request) -> Response:
    """Stores the profile under a new id (the ``Location`` header names it): 201. The same
    profile sent again (a retry, with or without ``created_at``) is stored once: 200 with the
    same id and the profile as first stored. A node's token
    (``publish`` as a node) stores only profiles of that node: 403 for another's. A profile
    whose numbers cannot be true (:func:`arrived`) is refused: 422 naming its fields."""
    grant: Grant | None = request.scope.get(GRANT_SCOPE_KEY)
    if grant is not None and grant.node is not None and body.node_name != grant.node:
        raise Problem(
            403,
            "wrong-node",
            f"this token publishes as node {grant.node!r} only, and the profile's node_name "
            f"is {body.node_name!r}: a node publishes its own profiles (use that node's token). "
            f"A profile's node_name is the first set of {', '.join(NODE_NAME_ENV_VARS)}, else "
            "the host name: on that node, set AUTOBATCH_NODE_NAME (or NODE_NAME) to its name",
            field="body.node_name",
        )

    profile = arrived(Profile.from_dict(body.model_dump()))

    def create() -> Response:
        try:
            profile_id, stored, new = state.store.publish(profile)
        except ProfileDeletedError as exc:
            raise deleted_profile(exc.profile_id) from None
        location = {"Location": f"/v1/profiles/{profile_id}"}
        answer = profile_public(profile_id, stored)
        return json_response(answer, status_code=201 if new else 200, headers=location)

    return await store_call(state, create)


def deleted_profile(profile_id: str) -> Problem:
    """410 ``deleted-profile``: the profile of ``profile_id`` was deleted here and is not
    stored again (a node's outbox takes a 410 as final and stops resending it)."""
    return Problem(
        410,
        "deleted-profile",
        f"profile {profile_id} was deleted and is not stored again (its deletion already "
        "reached the nodes); publish a new profile (probe again) instead of resending it",
        field="body",
    )


def arrived(profile: Profile) -> Profile:
    """``profile`` as the store keeps it, once it adds up against itself and its card
    (:func:`autobatch.planning.check_arrival`): a card autobatch's catalogue does not hold, its
    name and memory as NVML reported them, gets a note saying so (the same note on every
    resend, so a retry still finds the profile it stored).

    Raises:
        Problem: 422 ``implausible-profile``, naming each field at fault.
    """
    found = check_arrival(profile)
    if found:
        errors = [(f"body.{each.field}", each.reason) for each in found]
        raise Problem(
            422,
            "implausible-profile",
            "the profile does not add up, so no plan may rest on it: "
            + "; ".join(dict.fromkeys(each.reason for each in found)),
            errors=errors,
        )
    note = uncatalogued_note(profile)
    if note is None or note in profile.notes:
        return profile
    return dataclasses.replace(profile, notes=(*profile.notes, note))


FollowCursor = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,18}$",
        description="Follow the store: profiles stored after this cursor, oldest first ('0' "
        "from the first); each page's next_after is the next cursor. Misses none on either "
        "backend (the cursor follows commit order). Not with before.",
    ),
]


LatestPerNode = Annotated[
    bool,
    Query(
        description="With model_fingerprint: each node's latest profile of the model per thing "
        "it measured (card, step, conditions), newest first, at most limit: what the service's "
        "plans draw from (one voice per node, however often a node publishes), and what a node "
        "sidecar draws from when it holds none of the model. One page (no next_before), "
        "bounded by limit rather than bytes. Not with node_name, before or after.",
    ),
]


@router.get(
    "",
    summary="List stored profiles, newest first",
    response_model=ProfileList,
    responses=problem_responses(404, 422),
)
async def list_profiles(
    state: StateDep,
    listing: ListingDep,
    after: FollowCursor = None,
    latest_per_node: LatestPerNode = False,
) -> Response:
    """One page of at most ``limit`` profiles and about 512 KiB (``PAGE_BYTES``): memory and
    time per request stay bounded however large the profiles, and pages are built one at a
    time (``ServiceState.page_calls``), so the costliest listings cannot starve ``/healthz``.
    ``next_before`` asks for the next page; with ``after``, ``next_after`` does (oldest first).
    With ``latest_per_node``, each node's latest profiles of one model (:func:`_latest`)."""
    cursor = None if after is None else int(after)
    if latest_per_node:
        return await state.page_calls(_latest(state, listing, after))

    def page() -> Response:
        found = listing.read(state.store.page_profiles, max_bytes=PAGE_BYTES, after=cursor)
        return json_response(
            ProfileList(
                profiles=[profile_public(pid, profile) for pid, profile in found.profiles],
                next_before=found.next_before,
                next_after=None if found.next_after is None else str(found.next_after),
            )
        )

    return await state.page_calls(page)


def _latest(state: StateDep, listing: Listing, after: str | None) -> Callable[[], Response]:
    """The listing of each node's latest profile of ``listing.model_fingerprint`` per thing it
    measured (``ProfileStore.latest_per_node``, as the plan routes read it), filtered by exact
    ``device_name``; bounded by ``limit`` (1000 at most), as a plan by card reads.

    Raises:
        Problem: 422 without ``model_fingerprint``, or with ``node_name``, ``before`` or
            ``after``, naming the query field.
    """
    fingerprint, card = listing.model_fingerprint, listing.device_name
    refused = [
        (name, value)
        for name, value in (("node_name", listing.node_name), ("before", listing.before))
        if value is not None
    ] + ([("after", after)] if after is not None else [])
    if fingerprint is None or refused:
        field = "model_fingerprint" if fingerprint is None else refused[0][0]
        raise Problem(
            422,
            "validation",
            "latest_per_node lists one model's profiles, each node's latest per thing it "
            "measured, in one page: give model_fingerprint, and neither node_name, before nor "
            "after",
            field=f"query.{field}",
        )

    def page() -> Response:
        found = state.store.latest_per_node(
            model_fingerprint=fingerprint,
            limit=listing.limit,
            card=None if card is None else (lambda name: name == card),
        )
        return json_response(
            ProfileList(profiles=[profile_public(pid, profile) for pid, profile in found])
        )

    return page


@router.get(
    "/{profile_id}",
    summary="Read a profile",
    response_model=ProfilePublic,
    responses=problem_responses(404, 422),
)
async def get_profile(profile_id: IdPath, state: StateDep) -> Response:
    def read() -> Response:
        try:
            return json_response(profile_public(profile_id, state.store.get(profile_id)))
        except ProfileNotFoundError:
            raise unknown_profile(profile_id, field="path.profile_id") from None

    return await store_call(state, read)


@router.get(
    "/{profile_id}/report",
    summary="A profile's report: peak memory and time per sample against micro-batch",
    response_model=ProfileReport,
    responses=problem_responses(404, 422),
)
async def get_profile_report(profile_id: IdPath, state: StateDep) -> Response:
    """The data ``autobatch tune --report`` draws, for a stored profile: its mode's trials and
    its recommended micro-batch as the chosen point (:func:`autobatch.planning.profile_report`)."""

    def read() -> Response:
        try:
            profile = state.store.get(profile_id)
        except ProfileNotFoundError:
            raise unknown_profile(profile_id, field="path.profile_id") from None
        return json_response(ProfileReport.model_validate(profile_report(profile)))

    return await store_call(state, read)


@router.delete(
    "/{profile_id}",
    status_code=204,
    summary="Delete a profile",
    response_class=Response,
    responses=problem_responses(404, 422),
)
async def delete_profile(profile_id: IdPath, state: StateDep) -> Response:
    if not await store_call(state, state.store.delete, profile_id):
        raise unknown_profile(profile_id, field="path.profile_id")
    return Response(status_code=204)
