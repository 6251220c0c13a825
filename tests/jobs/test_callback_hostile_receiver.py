"""Hostile callback receivers against the real API process (issue 35, finding 1).

A receiver on an allowed host answered 200 with an endless body: the delivery read the whole answer
(the API grew from 196 MB to 4.1 GB in 6 s) and, the timeout being per read, a receiver sending a
byte now and then held it forever; after a restart the retried callback did it again (a crash loop).

Here a receiver (raw sockets, threads of this test process) streams endless bodies and headers and
drips bytes, and the real server (``engram-service serve``) delivers outbox entries to it, written to
its store as a finished job leaves them. Each delivery ends within ``ENGRAM_CALLBACK_TIMEOUT_S``; the
200 with an endless body counts as delivered (its status is the receiver's answer), every other
hostile answer is dead-lettered after ``ENGRAM_CALLBACK_MAX_ATTEMPTS`` naming why; the API's peak RSS
grows by less than a stated bound; and a restarted server sends nothing again. The "endless" streams
stop after 64 MiB each (then the connection stays open, silent) so the server without the fix fails
by a measured peak, not by taking gigabytes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server
from service.jobs.callbacks import enqueue
from service.jobs.records import JobRecord
from service.jobs.store import new_job
from service.storage.keys import FAILED_CALLBACKS, PENDING_CALLBACKS, job_key
from service.storage.local import LocalStorage
from tests.helpers.jobs import payload_for

SECRET = "test-callback-secret"
TIMEOUT_S = 2.0  # ENGRAM_CALLBACK_TIMEOUT_S: one delivery, connect to last byte
ATTEMPTS = 3
STREAM_BYTES = 64 << 20  # an "endless" stream, scaled down: the server without a cap reads all of it
DRIP_EVERY_S = 0.25  # well under the per-read timeout: only a deadline for the whole delivery ends it
PEAK_GROWTH_BOUND = 32 << 20  # without the cap, two 64 MiB bodies read at once add 128 MiB+
ENDLESS = b"x" * 65536

# path -> what the receiver answers there
MODES = {
    "/endless-200": b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\r\n",
    "/endless-500": b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\n\r\n",
    "/drip-body": b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 100000\r\n\r\n",
    "/drip-headers": b"HTTP/1.1 200 OK\r\nx-slow: ",
    "/endless-headers": b"HTTP/1.1 200 OK\r\nx-endless: ",
}
DELIVERED = {"/endless-200"}


@dataclass
class Connection:
    path: str
    opened_at: float
    closed_at: float | None = None
    sent: int = 0


@dataclass
class HostileReceiver:
    """Accepts deliveries and answers each by its path (:data:`MODES`), until the client hangs up."""

    sock: socket.socket
    stop: threading.Event = field(default_factory=threading.Event)
    connections: list[Connection] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            path = _read_request(conn)
            record = Connection(path, time.monotonic())
            with self.lock:
                self.connections.append(record)
            try:
                conn.sendall(MODES[path])
                if path.startswith("/endless"):
                    self._stream(conn, record)
                else:
                    self._drip(conn, record)
            except OSError:  # the client hung up: what every delivery must end with
                pass
            record.closed_at = time.monotonic()

    def _stream(self, conn: socket.socket, record: Connection) -> None:
        while record.sent < STREAM_BYTES and not self.stop.is_set():
            conn.sendall(ENDLESS)
            record.sent += len(ENDLESS)
        conn.settimeout(0.25)  # then silent, until the client hangs up
        while not self.stop.is_set():
            try:
                if conn.recv(1) == b"":
                    return
            except TimeoutError:
                continue

    def _drip(self, conn: socket.socket, record: Connection) -> None:
        while not self.stop.is_set():
            conn.sendall(b"a")
            record.sent += 1
            time.sleep(DRIP_EVERY_S)

    def finished(self, path: str) -> list[Connection]:
        with self.lock:
            return [c for c in self.connections if c.path == path]


def _read_request(conn: socket.socket) -> str:
    """The request's path, after reading its head and body (what a receiver does before answering)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return ""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = lengths[0] if lengths else 0
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b" ")[1].decode()


@pytest.fixture
def receiver() -> Iterator[HostileReceiver]:
    sock = socket.create_server(("127.0.0.1", 0))
    hostile = HostileReceiver(sock)
    thread = threading.Thread(target=hostile.serve, daemon=True)
    thread.start()
    try:
        yield hostile
    finally:
        hostile.stop.set()
        sock.close()


def _start(store: Path, root: Path, receiver: HostileReceiver) -> LiveServer:
    return start_server(
        store,
        root / "models",
        root / "server.log",
        ENGRAM_CALLBACK_HOSTS=f"127.0.0.1:{receiver.port}",
        ENGRAM_CALLBACK_SECRET=SECRET,
        ENGRAM_CALLBACK_TIMEOUT_S=str(TIMEOUT_S),
        ENGRAM_CALLBACK_MAX_ATTEMPTS=str(ATTEMPTS),
        ENGRAM_CALLBACK_BACKOFF_S="0.2",
        ENGRAM_CALLBACK_POLL_S="0.2",
    )


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def _finished_job() -> JobRecord:
    return new_job("map", payload_for("map"), unit="steps").updated(status="succeeded")


def _leave_callbacks(storage: LocalStorage, receiver: HostileReceiver) -> dict[str, str]:
    """A finished job per hostile mode, its outbox entry pending (as a job that just ended leaves it);
    returns the receiver's path of each job."""
    jobs = {}
    for path in MODES:
        job = _finished_job()
        storage.put_json(job_key(job.job_id), job.model_dump(mode="json"))
        enqueue(storage, job, (receiver.url(path),))
        jobs[job.job_id] = path
    return jobs


def _wait_for_empty_outbox(storage: LocalStorage, timeout: float) -> list[dict[str, object]]:
    """The entries still pending after ``timeout`` seconds (none, once every delivery has ended)."""
    deadline = time.monotonic() + timeout
    while storage.list(PENDING_CALLBACKS) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [storage.get_json(k) for k in storage.list(PENDING_CALLBACKS)]


def test_hostile_receivers_end_delivered_or_dead_lettered_within_the_deadline(
    tmp_path: Path, receiver: HostileReceiver
) -> None:
    (tmp_path / "models").mkdir()
    store = tmp_path / "store"
    server = _start(store, tmp_path, receiver)
    storage = LocalStorage(store)
    try:
        for _ in range(3):  # warm: the first requests allocate what later ones reuse
            assert server.client.get("/healthz").status_code == 200
        before = _peak_rss(server.process.pid)
        jobs = _leave_callbacks(storage, receiver)
        # Each entry: ATTEMPTS deliveries of at most TIMEOUT_S, with backoffs of 0.2 s and 0.4 s between.
        started = time.monotonic()
        pending = _wait_for_empty_outbox(storage, timeout=ATTEMPTS * (TIMEOUT_S + 1) + 10)
        took, growth = time.monotonic() - started, _peak_rss(server.process.pid) - before
        figure = f"hostile receivers: {took:.1f}s, API peak RSS +{growth / 2**20:.1f} MiB"
        print(f"\n{figure} (bound {PEAK_GROWTH_BOUND >> 20} MiB)")  # noqa: T201
        assert growth < PEAK_GROWTH_BOUND, f"the API's peak RSS grew by {growth} bytes"
        assert not pending, f"callbacks still pending after {took:.0f}s: {pending}"

        entries = [storage.get_json(k) for k in storage.list(FAILED_CALLBACKS)]
        failed = {jobs[entry["job_id"]]: entry for entry in entries}
        assert failed.keys() == set(MODES) - DELIVERED, failed
        assert all(entry["attempts"] == ATTEMPTS for entry in entries), entries
        assert failed["/endless-500"]["last_error"] == "HTTP 500"
        assert failed["/drip-body"]["last_error"] == "HTTP 500"  # its body was cut at the deadline
        assert "Timeout" in failed["/drip-headers"]["last_error"], failed["/drip-headers"]
        assert "RemoteProtocolError" in failed["/endless-headers"]["last_error"], failed["/endless-headers"]
        assert len(receiver.finished("/endless-200")) == 1, "a 2xx is delivered once"

        time.sleep(1.0)  # the receiver notices each hang-up within 0.25 s
        for path in MODES:
            for connection in receiver.finished(path):
                assert connection.closed_at is not None, f"{path}: a delivery still holds its connection"
                held = connection.closed_at - connection.opened_at
                assert held < TIMEOUT_S + 1.0, f"{path}: a delivery held its connection {held:.1f}s"
                assert connection.sent < STREAM_BYTES, f"{path}: the whole stream was read"
    finally:
        stop_server(server)

    sent = len(receiver.connections)
    restarted = _start(store, tmp_path, receiver)  # the crash loop was a restart delivering it all again
    try:
        time.sleep(2.0)  # ten polls of the outbox
        assert len(receiver.connections) == sent, "a restarted server called the hostile receiver again"
        assert restarted.client.get("/healthz").status_code == 200
    finally:
        stop_server(restarted)
