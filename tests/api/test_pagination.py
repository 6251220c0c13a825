"""Paginated lists (issue 23, finding 5): ``GET /concepts`` answered 1,221 concepts in one 498 KB body.

Every list route takes ``limit`` (default 100, at most 1000) and an opaque ``cursor``; the body is
still a JSON list, and the next page is named by ``Link: <...>; rel="next"`` and ``X-Next-Cursor``
(absent on the last page). The order is stable (keyset): paging while items are added serves every
item that existed when paging began exactly once.

The 250 concepts are written into the server's file storage as the service writes them (a concept
document without models): posting them would start 250 collections, which admission control and
the test's time budget both refuse, and a concept's collection has nothing to do with listing.

Pages are the app's answer, checked in this process (``tests.helpers.app``, the fast tier); the
job listing's test pauses a live server's job process to hold its jobs queued.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_schemas import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, NEXT_CURSOR_HEADER
from engram_fixtures.live import LiveServer, running_server, wait_for_job
from tests.helpers.api import READ_CACHE_S, register_model, write_concept
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.job_process import job_process, paused


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[InProcessServer]:
    """The app called in this process: what a page holds is the app's answer."""
    with in_process_server(tmp_path_factory.mktemp("pages"), model_root) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[LiveServer]:
    """The server process: its job process is paused to hold jobs queued."""
    with running_server(tmp_path_factory.mktemp("pages-live"), model_root) as live:
        yield live


def _pages(api: httpx.Client, path: str, limit: int, between: Any = None) -> Iterator[httpx.Response]:
    """Every page of ``path`` following ``Link``; ``between()`` runs after each page but the last."""
    url: str | None = f"{path}?limit={limit}"
    while url is not None:
        response = api.get(url)
        assert response.status_code == 200, response.text
        yield response
        link = response.headers.get("link")
        if link is None:
            assert NEXT_CURSOR_HEADER not in response.headers
            return
        assert link.endswith('>; rel="next"') and response.headers[NEXT_CURSOR_HEADER] in link
        url = link[1 : link.index(">")]
        if between is not None:
            between()


@pytest.mark.fast
def test_paging_through_250_concepts_serves_each_exactly_once_while_others_are_added(app: InProcessServer) -> None:
    server = app
    api = server.client
    names = [f"c{index:03d}" for index in range(250)]
    for name in names:
        write_concept(server, name)
    time.sleep(READ_CACHE_S)
    added: list[str] = []

    def add_some() -> None:  # new concepts sorting before, among and after those still to come
        for name in (f"a-{len(added)}", f"c{len(added):03d}x", f"z-{len(added)}"):
            write_concept(server, name)
            added.append(name)
        time.sleep(READ_CACHE_S)

    pages = list(_pages(api, "/concepts", 100, add_some))
    served = [c["name"] for page in pages for c in page.json()]
    assert [len(page.json()) for page in pages][:2] == [100, 100]
    assert len(served) == len(set(served))  # nothing twice
    assert set(names) <= set(served)  # nothing that existed is skipped
    assert served == sorted(served)  # one stable order: by name
    assert set(served) - set(names) <= set(added)

    first = api.get("/concepts")  # the default page size
    assert len(first.json()) == DEFAULT_PAGE_SIZE and NEXT_CURSOR_HEADER in first.headers


@pytest.mark.fast
def test_a_bad_cursor_or_limit_is_a_problem(app: InProcessServer) -> None:
    api = app.client
    for cursor in ("nonsense", "eyJ2IjoxfQ", "%%%"):
        response = api.get("/concepts", params={"cursor": cursor})
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert "X-Next-Cursor" in response.json()["detail"]
    for limit in (0, MAX_PAGE_SIZE + 1):
        response = api.get("/concepts", params={"limit": limit})
        assert response.status_code == 422, response.text
        assert response.headers["content-type"].startswith("application/problem+json")


def test_every_list_route_pages(server: LiveServer, tiny_llama_dir: Path) -> None:
    """/models, /jobs, /variants, /models/{id}/variants and /models/{id}/universes take limit and cursor too."""
    api = server.client
    for index in range(3):
        register_model(api, f"paged/m{index}", f"file://{tiny_llama_dir}")
    served = [m["model_id"] for page in _pages(api, "/models", 2) for m in page.json()]
    assert served == ["paged/m0", "paged/m1", "paged/m2"]

    with paused(job_process(server)):
        jobs = [
            api.post("/models", params={"wait": 0}, json={"model_id": f"paged/q{i}", "source": f"file://{tiny_llama_dir}"})
            for i in range(3)
        ]
        assert all(r.status_code == 202 for r in jobs)
        pages = list(_pages(api, "/jobs", 2))
        assert [len(p.json()) for p in pages] == [2, 1]
        assert [j["job_id"] for p in pages for j in p.json()] == [r.json()["job_id"] for r in jobs]  # oldest first
    for response in jobs:
        wait_for_job(api, response.json()["job_id"])

    for path in ("/variants", "/models/paged/m0/variants", "/models/paged/m0/universes"):
        response = api.get(path, params={"limit": 1})
        assert response.status_code == 200 and response.json() == [], (path, response.text)
        assert "link" not in response.headers


@pytest.mark.fast
def test_a_page_skips_what_its_view_leaves_out_and_stops_one_past_the_limit() -> None:
    """Page.select without a server: a filtered list (one model's variants) fills its pages with
    the items kept, and reads only up to one item past the page."""
    from starlette.requests import Request
    from starlette.responses import Response

    from service.api.pagination import Page, decode_cursor

    scope = {"type": "http", "method": "GET", "path": "/variants", "query_string": b"model_id=m", "headers": []}
    read: list[str] = []

    def view(key: tuple[str, ...]) -> str | None:
        read.append(key[0])
        return key[0] if int(key[0]) % 2 == 0 else None  # the odd ones are another model's

    keys = [(f"{i:02d}",) for i in range(20)]
    response = Response()
    page = Page(3, None, Request(scope), response)
    items, next_key = page.select(keys, view)
    assert items == ["00", "02", "04"] and next_key == ("04",) and read[-1] == "06"
    assert page.answer(items, next_key) == items
    cursor = response.headers["x-next-cursor"]
    assert decode_cursor(cursor) == ("04",)
    assert response.headers["link"] == f'</variants?model_id=m&cursor={cursor}&limit=3>; rel="next"'
    rest, last = Page(10, ("04",), Request(scope), Response()).select(keys, view)
    assert rest == ["06", "08", "10", "12", "14", "16", "18"] and last is None
