"""A request's head is capped in the server the service runs (issue 35, finding 2).

httptools has no header limit: a 100 MB header on ``/healthz`` (no key needed) was buffered whole
and answered 200, and four parallel 200 MB heads took the API from 693 MB to 1.8 GB. Against the
real ``engram-service serve`` process (:func:`engram_fixtures.live.start_server` runs
``python -m service.cli serve``): a head past ``ENGRAM_MAX_HEADER_BYTES`` is answered 431 at once
and the connection closed, eight parallel 4 MB heads leave the server's peak RSS within a stated
bound, and requests under the cap (a large header, a body larger than the cap in one write, two
requests on one connection) are served as before.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server

CAP = 16 * 1024  # the server's ENGRAM_MAX_HEADER_BYTES here: small, so "under the cap" stays cheap
ATTACK_BYTES = 4 << 20  # one hostile head; the server without a cap buffers each one whole
PARALLEL = 8
PEAK_GROWTH_BOUND = 16 << 20  # 8 x 4 MB heads buffered whole grow the peak by 32 MB+: capped, by ~nothing


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("header-limit")
    (root / "models").mkdir()
    live = start_server(root / "store", root / "models", root / "server.log", ENGRAM_MAX_HEADER_BYTES=str(CAP))
    try:
        yield live
    finally:
        stop_server(live)


def _port(server: LiveServer) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def _read_answer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What the server sent before it closed (a reset after its answer is a close too)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _send_head(port: int, header_bytes: int) -> tuple[bytes, float]:
    """A GET /healthz whose one header is ``header_bytes`` long, sent in 64 KiB writes until the server
    answers or closes; returns what it answered and the seconds it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: engram\r\nX-Padding: ")
        chunk, sent = b"a" * 65536, 0
        try:
            while sent < header_bytes and not select.select([sock], [], [], 0)[0]:
                sock.sendall(chunk[: header_bytes - sent])
                sent += len(chunk)
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the server refused and closed: its answer was sent first
            pass
        answer = _read_answer(sock)
    return answer, time.monotonic() - started


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def test_a_head_past_the_cap_is_431_at_once_naming_the_setting(server: LiveServer) -> None:
    answer, seconds = _send_head(_port(server), 1 << 20)
    assert _status(answer) == 431, answer[:300]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/problem+json" in head.lower()
    assert b"connection: close" in head.lower()
    problem = json.loads(body)
    assert problem["status"] == 431 and "ENGRAM_MAX_HEADER_BYTES" in problem["detail"], problem
    assert seconds < 5, f"answered after {seconds:.1f}s"
    assert server.client.get("/healthz").status_code == 200


def test_parallel_hostile_heads_leave_the_servers_memory_bounded(server: LiveServer) -> None:
    pid = server.process.pid
    for _ in range(3):  # warm: the first requests import and allocate what every later one reuses
        _send_head(_port(server), CAP // 2)
        _send_head(_port(server), 1 << 20)
    before = _peak_rss(pid)
    with ThreadPoolExecutor(PARALLEL) as pool:
        answers = list(pool.map(lambda _: _send_head(_port(server), ATTACK_BYTES), range(PARALLEL)))
    growth = _peak_rss(pid) - before
    figure = f"{PARALLEL} x {ATTACK_BYTES >> 20} MB heads: peak RSS +{growth / 2**20:.1f} MiB"
    print(f"\n{figure} (bound {PEAK_GROWTH_BOUND >> 20} MiB)")  # noqa: T201
    assert [_status(answer) for answer, _ in answers] == [431] * PARALLEL
    assert max(seconds for _, seconds in answers) < 10
    assert growth < PEAK_GROWTH_BOUND, f"peak RSS grew by {growth} bytes"
    assert server.client.get("/healthz").status_code == 200


def test_requests_under_the_cap_are_served(server: LiveServer) -> None:
    """A header just under the cap; a body (any size) is not head, even when it comes in the same read."""
    answer, _ = _send_head(_port(server), CAP - 200)
    assert _status(answer) == 200, answer[:300]
    records = [{"text": "x" * 1000} for _ in range(200)]  # ~200 KB of body, 12 times the cap
    body = json.dumps({"name": "c", "models": ["no/such-model"], "records": records}).encode()
    request = (
        b"POST /concepts HTTP/1.1\r\nHost: engram\r\ncontent-type: application/json\r\n"
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + body
    )
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(request)  # one write: the server reads head and body together
        answer = _read_answer(sock)
    assert _status(answer) not in {431, 400}, answer[:300]
    assert b"no/such-model" in answer


def test_the_cap_applies_to_each_request_of_a_kept_alive_connection(server: LiveServer) -> None:
    """Two requests just under the cap on one connection are both served; the head count starts anew."""
    padding = b"a" * (CAP - 200)
    one = b"GET /healthz HTTP/1.1\r\nHost: engram\r\nX-Padding: " + padding + b"\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nHost: engram\r\nconnection: close\r\nX-Padding: " + padding + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(one + last)
        answer = _read_answer(sock)
    assert answer.count(b"HTTP/1.1 200 OK") == 2, answer[:500]
