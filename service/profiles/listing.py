"""What the two profile listings (``GET /v1/profiles``, ``GET /v1/profile-summaries``) share:
the filters and paging parameters, and the one translation of an unknown ``before`` id into 404.

Example::

    async def list_summaries(state: StateDep, listing: ListingDep) -> Response:
        return await store_call(state, lambda: answer(listing.read(state.store.list_summaries)))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Query
from pydantic import AfterValidator

from autobatch.errors import ProfileNotFoundError
from service.web.problems import unknown_profile
from service.web.schemas import MAX_NAME_CHARS, storable

__all__ = ["Listing", "ListingDep"]

PageT = TypeVar("PageT")
_STORABLE = AfterValidator(lambda value: value if value is None else storable(value))
_Filter = Annotated[str | None, Query(max_length=MAX_NAME_CHARS), _STORABLE]


class Listing:
    """A listing request's query: filters (model, card, node), ``limit`` and ``before``."""

    def __init__(
        self,
        model_fingerprint: Annotated[
            str | None, Query(max_length=MAX_NAME_CHARS), _STORABLE
        ] = None,
        device_name: Annotated[str | None, Query(max_length=MAX_NAME_CHARS), _STORABLE] = None,
        node_name: Annotated[str | None, Query(max_length=MAX_NAME_CHARS), _STORABLE] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        before: Annotated[str | None, Query(max_length=64), _STORABLE] = None,
    ) -> None:
        self.model_fingerprint = model_fingerprint
        self.device_name = device_name
        self.node_name = node_name
        self.limit = limit
        self.before = before

    def read(self, page: Callable[..., PageT], **options: object) -> PageT:
        """``page(<the filters>, limit=, before=, **options)``: one page from the store (a
        blocking call: run it on the store's threads, ``service.web.store_calls``).

        Raises:
            Problem: 404 when ``before`` names no stored profile.
        """
        try:
            return page(
                model_fingerprint=self.model_fingerprint,
                device_name=self.device_name,
                node_name=self.node_name,
                limit=self.limit,
                before=self.before,
                **options,
            )
        except ProfileNotFoundError:
            raise unknown_profile(self.before or "", field="query.before") from None


ListingDep = Annotated[Listing, Depends()]
