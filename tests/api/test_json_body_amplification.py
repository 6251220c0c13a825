"""A JSON body within its byte limit is bounded by what it costs once decoded (issue 35: "the API
bounds what a request may make it hold").

Two bytes of ``{},`` become ~150 bytes of Python objects once decoded and validated: a 28 MiB body
of ten million empty records took a fresh API from 168 MiB to 1.7 GiB before ``POST /concepts``
answered 422, and it kept 1.5 GiB afterwards; ten million empty evaluate probes took it to 973 MiB,
fifteen million integers in ``POST /models`` labels to 398 MiB. Against the real ``engram-service
serve`` process (:func:`engram_fixtures.live.start_server`), each of those bodies, scaled down, and
four at once are answered 413 naming ``ENGRAM_MAX_JSON_VALUES`` and what to send instead, while the
server's peak RSS (``VmHWM``, reset through ``clear_refs``) grows by less than ``3 x the bodies +
64 MiB``: the body as received in chunks and joined (2x), one copy while its values are counted
(the strings-out pass), and 64 MiB for the interpreter's own work on four connections (threads,
the answer, the allocator's rounding). Its resident set afterwards is within the body + 64 MiB of before: the
allocator keeps the heap the body's chunks were received in, for the next request.
A body whose commas and colons sit inside strings is counted exactly and reaches its route.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server
from tests.helpers.job_process import peak_rss_bytes

MiB = 1 << 20
NOISE = 64 * MiB  # what the interpreter may add to a request's bytes: threads, the answer, allocator rounding
VALUES_LIMIT = 500_000  # ENGRAM_MAX_JSON_VALUES's default, stated for the server so the test reads alone
EVALUATE = "/variants/" + "0" * 64 + "/evaluate"


def concepts_body(records: int) -> bytes:
    return b'{"name":"x","models":["m/x"],"records":[' + b"{}," * (records - 1) + b"{}]}"


def evaluate_body(probes: int) -> bytes:
    return b'{"forget":[' + b"{}," * (probes - 1) + b"{}]}"


def models_body(labels: int) -> bytes:
    return b'{"model_id":"a/b","source":"file:///x","labels":[' + b"0," * (labels - 1) + b"0]}"


def serve(root: Path) -> LiveServer:
    (root / "models").mkdir()
    return start_server(
        root / "store",
        root / "models",
        root / "server.log",
        ENGRAM_MAX_JSON_BYTES=str(32 * MiB),
        ENGRAM_MAX_JSON_VALUES=str(VALUES_LIMIT),
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    """A server of the test's own: what the allocator kept from another test's body would hide a peak."""
    live = serve(tmp_path)
    try:
        yield live
    finally:
        stop_server(live)


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def reset_peak(pid: int) -> int:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := the resident set now
    return peak_rss_bytes(pid)


def post(server: LiveServer, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.base_url + path, content=body, headers=headers, timeout=120)


def assert_refused_by_values(response: httpx.Response, what_to_send: str) -> None:
    assert response.status_code == 413, response.text[:300]
    assert response.headers["content-type"].startswith("application/problem+json")
    detail = response.json()["detail"]
    assert "ENGRAM_MAX_JSON_VALUES" in detail, detail
    assert f"{VALUES_LIMIT:,}" in detail, detail
    assert what_to_send in detail, detail


# (path, body, what the refusal tells the user to send instead); the models body is as large as
# measured because integers cost the API least (~16 bytes each): smaller, main stays under the bound.
ATTACKS = {
    "concepts": ("/concepts", concepts_body(2_500_000), "multipart JSONL 'dataset' upload"),
    "evaluate": (EVALUATE, evaluate_body(2_500_000), "split the request"),
    "models": ("/models", models_body(15_000_000), "split the request"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_body_of_many_small_values_is_refused_before_it_is_decoded(server: LiveServer, name: str) -> None:
    path, body, what_to_send = ATTACKS[name]
    pid = server.process.pid
    resident_before = resident_bytes(pid)
    start = reset_peak(pid)
    response = post(server, path, body)
    growth = peak_rss_bytes(pid) - start
    kept = resident_bytes(pid) - resident_before
    bound = 3 * len(body) + NOISE
    figures = f"peak +{growth / MiB:.0f} MiB (bound {bound / MiB:.0f}), kept {kept / MiB:+.0f} MiB"
    print(f"{name}: {len(body) / MiB:.1f} MiB body, {figures}")  # noqa: T201
    assert growth < bound, f"{name}: the API's peak grew {growth / MiB:.0f} MiB (bound {bound / MiB:.0f})"
    assert kept < len(body) + NOISE, f"{name}: the API kept {kept / MiB:.0f} MiB after refusing the body"
    assert_refused_by_values(response, what_to_send)


def test_four_such_bodies_at_once_stay_within_the_bound(server: LiveServer) -> None:
    requests = [
        ("/concepts", concepts_body(1_000_001), "multipart JSONL 'dataset' upload"),
        ("/concepts", concepts_body(1_200_000), "multipart JSONL 'dataset' upload"),
        (EVALUATE, evaluate_body(1_000_001), "split the request"),
        ("/models", models_body(4_000_000), "split the request"),
    ]
    pid = server.process.pid
    start = reset_peak(pid)
    with ThreadPoolExecutor(len(requests)) as pool:
        responses = list(pool.map(lambda r: post(server, r[0], r[1]), requests))
    growth = peak_rss_bytes(pid) - start
    sent = sum(len(body) for _, body, _ in requests)
    bound = 3 * sent + NOISE
    print(f"at once: {sent / MiB:.1f} MiB of bodies, peak +{growth / MiB:.0f} MiB (bound {bound / MiB:.0f})")  # noqa: T201
    assert growth < bound, f"the API's peak grew {growth / MiB:.0f} MiB (bound {bound / MiB:.0f})"
    for response, (_, _, what_to_send) in zip(responses, requests, strict=True):
        assert_refused_by_values(response, what_to_send)


def test_commas_and_colons_inside_strings_are_not_values(server: LiveServer) -> None:
    """Their structural count passes the bound, the exact one does not: the route answers as ever."""
    text = "a, b: [c, d], " * 8  # 8 commas, 8 colons and 8 brackets a record: 25 by the cheap count
    records = [{"text": f"{text}{i}"} for i in range(60_000)]  # 120,001 values, ~1.5 million by the cheap count
    body = json.dumps({"name": "commas", "models": ["nobody/none"], "records": records}).encode()
    response = post(server, "/concepts", body)
    assert "ENGRAM_MAX_JSON_VALUES" not in response.text, response.text[:300]
    assert response.status_code == 404, response.text[:300]  # the route's own answer: no such model
    assert "nobody/none" in response.json()["detail"]
