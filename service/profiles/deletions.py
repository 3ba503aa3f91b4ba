"""``/v1/profile-deletions``: the tombstones of deleted profiles, oldest first after a cursor,
which node sidecars follow to forget their copies (``service.fleet.forgetting``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from service.deps import StateDep
from service.profiles.routes import json_response
from service.web.problems import problem_responses
from service.web.store_calls import store_call

__all__ = ["DeletionList", "DeletionPublic", "router"]

router = APIRouter(
    prefix="/v1/profile-deletions",
    tags=["profiles"],
    responses=problem_responses(401, 503),
)


class DeletionPublic(BaseModel):
    """A profile the service deleted."""

    model_config = ConfigDict(extra="forbid")

    profile_id: str
    deleted_at: str = Field(description="ISO 8601 time of the deletion (UTC)")


class DeletionList(BaseModel):
    """One page of deletions, oldest first."""

    model_config = ConfigDict(extra="forbid")

    deletions: list[DeletionPublic]
    next_after: str = Field(
        description="The cursor to ask with next; the same one when nothing was deleted since"
    )


@router.get(
    "",
    summary="List deleted profiles, oldest first after a cursor",
    response_model=DeletionList,
    responses=problem_responses(422),
)
async def list_deletions(
    state: StateDep,
    after: Annotated[
        str,
        Query(
            pattern=r"^[0-9]{1,18}$",
            description="Profiles deleted after this cursor ('0' from the first); each page's "
            "next_after is the next cursor. Follows commit order on either backend.",
        ),
    ] = "0",
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> Response:
    """At most ``limit`` deletions (a few dozen bytes each), read on the store's threads under
    the store deadline (``service.web.store_calls``)."""

    def page() -> Response:
        found = state.store.page_deletions(after=int(after), limit=limit)
        return json_response(
            DeletionList(
                deletions=[
                    DeletionPublic(profile_id=d.profile_id, deleted_at=d.deleted_at)
                    for d in found.deletions
                ],
                next_after=str(found.next_after),
            )
        )

    return await store_call(state, page)
