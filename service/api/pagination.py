"""Paginated lists: ``?limit=`` and an opaque ``?cursor=``, the body still a JSON list.

Why the body stays a list: every client written so far (ours, scripts, dashboards) reads these
routes as a JSON array, and a list that fits one page (the default page holds 100) answers exactly
as an unpaginated list. The next page is named by headers instead: ``Link: <...>; rel="next"`` (RFC 8288, what
GitHub's and many HTTP clients' pagination follows) and ``X-Next-Cursor`` (the bare cursor, for
clients that build their own URL); the last page carries neither.

Order: each list is sorted by a key that never changes once an item exists (a name, an ID, a
creation time and an ID), and a cursor is the key of the last item served (keyset pagination): the
next page starts strictly after it. Items added while a client pages therefore land before the
cursor (the client never sees them) or after it (it does), and an item that existed when paging
began is served exactly once, never repeated or skipped, whatever else is added or removed.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Query, Request, Response

from api_schemas import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, NEXT_CURSOR_HEADER
from service.errors import ProblemError

T = TypeVar("T")
SortKey = tuple[str, ...]
_VERSION = 1

PAGED_HEADERS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "one page, in the list's stable order",
        "headers": {
            "Link": {
                "description": 'the next page, as `<url>; rel="next"`; absent on the last page',
                "schema": {"type": "string"},
            },
            NEXT_CURSOR_HEADER: {
                "description": "the `cursor` of the next page; absent on the last page",
                "schema": {"type": "string"},
            },
        },
    },
    400: {"description": "`cursor` is not one this service gave"},
}


class InvalidCursor(ProblemError):
    status, title, slug = 400, "Invalid cursor", "invalid-cursor"


@dataclass(frozen=True)
class Page:
    """One list request's page: its size, where it starts, and the response whose headers name the next."""

    limit: int
    after: SortKey | None
    request: Request
    response: Response

    def select(self, keys: Iterable[SortKey], view: Callable[[SortKey], T | None]) -> tuple[list[T], SortKey | None]:
        """This page of the items named by ``keys`` (ascending): ``view`` makes an item (None: left
        out, such as another model's) and is called only for the page and one item past it.

        Returns:
            (the items, the sort key of the last one when more follow, else None).
        """
        items: list[T] = []
        last: SortKey | None = None
        for key in keys:
            if self.after is not None and key <= self.after:
                continue
            item = view(key)
            if item is None:
                continue
            if len(items) == self.limit:
                return items, last
            items.append(item)
            last = key
        return items, None

    def answer(self, items: list[T], next_key: SortKey | None) -> list[T]:
        """The page's body; names the next page in the response's headers when there is one."""
        if next_key is not None:
            cursor = encode_cursor(next_key)
            url = self.request.url.include_query_params(cursor=cursor, limit=self.limit)
            self.response.headers["Link"] = f'<{url.path}?{url.query}>; rel="next"'
            self.response.headers[NEXT_CURSOR_HEADER] = cursor
        return items


def encode_cursor(key: SortKey) -> str:
    raw = json.dumps({"v": _VERSION, "after": list(key)}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> SortKey:
    """The sort key a cursor from :func:`encode_cursor` names.

    Raises:
        InvalidCursor: anything else.
    """
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        after = data["after"]
        if data["v"] != _VERSION or not isinstance(after, list) or not all(isinstance(p, str) for p in after):
            raise ValueError(after)
    except (ValueError, TypeError, KeyError, binascii.Error, UnicodeDecodeError):
        raise InvalidCursor(
            "cursor is not one this service gave: pass the previous page's X-Next-Cursor (or follow its "
            'Link rel="next") unchanged, or leave cursor out to start from the first page'
        ) from None
    return tuple(after)


LimitQuery = Annotated[
    int, Query(ge=1, le=MAX_PAGE_SIZE, description=f"items per page (default {DEFAULT_PAGE_SIZE}, at most {MAX_PAGE_SIZE})")
]
CursorQuery = Annotated[
    str | None,
    Query(max_length=4096, description='where the page starts: the previous page\'s X-Next-Cursor (or its Link rel="next")'),
]


async def page_of_request(
    request: Request, response: Response, limit: LimitQuery = DEFAULT_PAGE_SIZE, cursor: CursorQuery = None
) -> Page:
    return Page(limit, decode_cursor(cursor) if cursor is not None else None, request, response)


PageDep = Annotated[Page, Depends(page_of_request)]
