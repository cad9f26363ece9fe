"""OpenAI's cursor pagination for list endpoints: `after` (an id), `limit`, `order`; each page
says `has_more`, `first_id` and `last_id`, and the official client asks again with
`after=last_id` until `has_more` is false.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from fastapi import Query

from mmkv.errors import MMKVError

T = TypeVar("T")
MAX_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class PageQuery:
    after: str | None
    limit: int
    order: Literal["asc", "desc"]


def page_query(after: str | None = Query(None, min_length=1,
                                         description="List after this id (the previous page's last_id)."),
               limit: int = Query(MAX_LIMIT, ge=1, le=MAX_LIMIT),
               order: Literal["asc", "desc"] = Query("desc", description="By creation time.")) -> PageQuery:
    """FastAPI dependency: the query's paging parameters (a bad one is a 400 naming it)."""
    return PageQuery(after, limit, order)


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool


def paginate(items: Sequence[T], id_of: Callable[[T], str], query: PageQuery,
             not_found: type[MMKVError]) -> Page[T]:
    """One page of `items` (given oldest first). An `after` that is not in the list names an item
    that does not exist (any more): `not_found` (a 404), naming `after`."""
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    start = 0
    if query.after is not None:
        ids = [id_of(item) for item in ordered]
        if query.after not in ids:
            raise not_found(f"no item with id {query.after!r} in this list (deleted?); list again without after",
                            param="after")
        start = ids.index(query.after) + 1
    page = ordered[start:start + query.limit]
    return Page(page, id_of(page[0]) if page else None, id_of(page[-1]) if page else None,
                start + len(page) < len(ordered))
