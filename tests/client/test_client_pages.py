"""The client and the CLI on paginated lists (issue 23, finding 5).

A list method reads every page by default (``EngramClient(page_size=...)`` items per request) and
returns a :class:`engram_client.Page` (a list with ``next_cursor``); ``limit``/``cursor`` read one
page. The CLI's list commands follow every page unless ``--limit``/``--cursor`` is given, and then
say on stderr how to ask for the next one.

The server is a real one of this module's own; its 250 concepts are written into its file storage
as the service writes them (collecting 250 concepts would start 250 jobs, past admission control,
for nothing that listing depends on).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engram_client import EngramClient, Page
from engram_fixtures.live import LiveServer, running_server
from tests.helpers.api import READ_CACHE_S, write_concept
from tests.helpers.cli import ok, run_cli

NAMES = [f"p{index:03d}" for index in range(250)]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[LiveServer]:
    with running_server(tmp_path_factory.mktemp("client-pages"), model_root) as server:
        for name in NAMES:
            write_concept(server, name)
        time.sleep(READ_CACHE_S)
        yield server


def test_a_list_method_reads_every_page(seeded: LiveServer) -> None:
    requests: list[httpx.Request] = []
    with EngramClient(seeded.base_url, page_size=100) as engram:
        engram._http.event_hooks["request"].append(requests.append)
        concepts = engram.list_concepts()
    assert [c.name for c in concepts] == NAMES  # each once, in the service's order
    assert isinstance(concepts, Page) and concepts.next_cursor is None
    assert len(requests) == 3  # 100 + 100 + 50


def test_limit_and_cursor_read_one_page(seeded: LiveServer) -> None:
    with EngramClient(seeded.base_url) as engram:
        first = engram.list_concepts(limit=100)
        assert [c.name for c in first] == NAMES[:100] and first.next_cursor is not None
        second = engram.list_concepts(limit=200, cursor=first.next_cursor)
        assert [c.name for c in second] == NAMES[100:] and second.next_cursor is None
        assert engram.list_models(limit=5) == [] and engram.list_jobs(limit=5).next_cursor is None


def test_a_server_without_pages_is_read_whole() -> None:
    """A service from before pagination ignores limit and sends no cursor: its one answer is the list.
    (A mock transport stands in for that older server: this repository no longer has one.)"""

    def older(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[])

    with EngramClient("http://engram.test", transport=httpx.MockTransport(older)) as engram:
        assert engram.list_variants() == [] and engram.list_variants().next_cursor is None


def test_the_cli_follows_pages_unless_limited(seeded: LiveServer) -> None:
    whole = ok(run_cli(seeded.base_url, "concepts", "list", "--json"))
    assert [c["name"] for c in json.loads(whole.stdout)] == NAMES
    assert "--cursor" not in whole.stderr

    page = ok(run_cli(seeded.base_url, "concepts", "list", "--limit", "240", "--json"))
    assert [c["name"] for c in json.loads(page.stdout)] == NAMES[:240]
    cursor = page.stderr.split("--cursor", 1)[1].split()[0]
    rest = ok(run_cli(seeded.base_url, "concepts", "list", "--cursor", cursor, "--json"))
    assert [c["name"] for c in json.loads(rest.stdout)] == NAMES[240:]
    assert "--cursor" not in rest.stderr

    table = ok(run_cli(seeded.base_url, "concepts", "list", "--limit", "3"))
    assert "p000" in table.stdout and "p003" not in table.stdout and "more items follow" in table.stderr
    assert run_cli(seeded.base_url, "concepts", "list", "--limit", "0").returncode == 2  # a usage error
