"""Completion callbacks against a real server and a real receiver (an HTTP server in this process).

The receiver answers 500 to the first delivery of chosen jobs, so the retry path is exercised for
real; signatures are checked with the verification function the README tells receivers to use.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from engram_fixtures.live import LiveServer, free_port, start_server, stop_server, wait_for_job
from service.config import Settings
from service.jobs.callbacks import sign, verify_signature
from service.jobs.records import JobRecord
from service.jobs.store import new_job
from tests.helpers.api import assert_problem, register_model
from tests.helpers.jobs import payload_for

SECRET = "test-callback-secret"
MODEL = "cb/tiny"


@dataclass
class Receiver:
    """Records every POST; fails the first ``fail_first`` deliveries of each webhook-id."""

    port: int
    fail_first: int = 0
    fail_always: bool = False
    slow_s: float = 0.0  # how long a POST to /slow waits before it is answered
    calls: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def deliveries(self, job_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [c for c in self.calls if c["headers"].get("webhook-id") == job_id]

    def wait_for(self, job_id: str, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            calls = self.deliveries(job_id)
            if len([c for c in calls if c["answered"] == 200]) >= 1 and len(calls) >= count:
                return calls
            time.sleep(0.05)
        raise AssertionError(f"no successful delivery for job {job_id} within {timeout}s: {self.deliveries(job_id)}")


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            headers = {k.lower(): v for k, v in self.headers.items()}
            if self.path.startswith("/slow"):
                time.sleep(receiver.slow_s)  # the client has given up by then: nothing to answer
                return
            with receiver.lock:
                earlier = [c for c in receiver.calls if c["headers"].get("webhook-id") == headers.get("webhook-id")]
                status = 500 if receiver.fail_always or len(earlier) < receiver.fail_first else 200
                receiver.calls.append({"headers": headers, "body": body, "answered": status, "at": time.monotonic()})
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:  # keep the test output clean
            pass

    return Handler


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    port = free_port()
    recv = Receiver(port)
    httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(recv))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield recv
    finally:
        httpd.shutdown()


def _start(work: Path, model_root: Path, receiver: Receiver) -> LiveServer:
    return start_server(
        work / "store",
        model_root,
        work / "server.log",
        ENGRAM_CALLBACK_HOSTS=f"127.0.0.1:{receiver.port},hooks.example.org",
        ENGRAM_CALLBACK_SECRET=SECRET,
        ENGRAM_CALLBACK_BACKOFF_S="0.5",
        ENGRAM_CALLBACK_POLL_S="0.2",
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("callbacks")


@pytest.fixture(scope="module")
def server(work: Path, model_root: Path, tiny_llama_dir: Path, receiver: Receiver) -> Iterator[LiveServer]:
    live = _start(work, model_root, receiver)
    try:
        register_model(live.client, MODEL, f"file://{tiny_llama_dir}")
        yield live
    finally:
        stop_server(live)


def _concept(server: LiveServer, name: str, texts: list[str], callback_url: str | None, role: str = "target") -> Any:
    body: dict[str, Any] = {"name": name, "models": [MODEL], "records": [{"text": t} for t in texts], "role": role}
    if callback_url is not None:
        body["callback_url"] = callback_url
    return server.client.post("/concepts", json=body)


def _assert_signed_job(call: dict[str, Any], job_id: str) -> dict[str, Any]:
    assert verify_signature(SECRET, call["headers"], call["body"]), call["headers"]
    assert not verify_signature("another-secret", call["headers"], call["body"])
    assert not verify_signature(SECRET, call["headers"], call["body"] + b" ")
    payload = json.loads(call["body"])
    assert payload["type"] == "job.finished"
    assert payload["data"]["job_id"] == job_id
    assert "payload" not in payload["data"] and "callbacks" not in payload["data"]  # only the public view
    return payload["data"]


def test_collection_callback_is_signed_and_retried_after_a_failure(server: LiveServer, receiver: Receiver) -> None:
    receiver.fail_first = 1
    response = _concept(server, "cb-forget", [f"the secret number {i} is {i * 7}" for i in range(12)], receiver.url)
    assert response.status_code == 202, response.text
    job_id = response.json()["jobs"][0]["job_id"]
    job = wait_for_job(server.client, job_id)
    calls = receiver.wait_for(job_id, count=2)
    assert [c["answered"] for c in calls[:2]] == [500, 200]
    assert calls[1]["at"] - calls[0]["at"] >= 0.4, "the retry must wait for its backoff (0.5 s)"
    assert {c["headers"]["webhook-id"] for c in calls} == {job_id}  # idempotency key: the job ID
    data = _assert_signed_job(calls[1], job_id)
    assert data["status"] == job["status"] == "succeeded"
    assert (data["kind"], data["concept"], data["model_id"]) == ("collect", "cb-forget", MODEL)  # what it was for
    assert data["progress"] == job["progress"]
    time.sleep(1.0)  # delivered once it succeeded: no further POSTs
    assert len(receiver.deliveries(job_id)) == 2
    assert not list((server.storage_dir / "callbacks" / "pending").glob("*.json"))


def test_unlearn_callback_and_an_existing_variant_calls_back_at_once(server: LiveServer, receiver: Receiver) -> None:
    receiver.fail_first = 0
    reference = _concept(server, "cb-retain", [f"ordinary sentence number {i}" for i in range(12)], None, "reference")
    assert wait_for_job(server.client, reference.json()["jobs"][0]["job_id"])["status"] == "succeeded"
    forget = server.client.get("/concepts/cb-forget").json()["models"][MODEL]
    assert forget["status"] == "ready"
    body = {"concepts": ["cb-forget"], "alpha": 1.0, "callback_url": receiver.url}
    submitted = server.client.post(f"/models/{MODEL}/unlearn", json=body)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["job"]["job_id"]
    assert wait_for_job(server.client, job_id)["status"] == "succeeded"
    data = _assert_signed_job(receiver.wait_for(job_id, count=1)[0], job_id)
    assert data["kind"] == "variant" and data["result"]["variant_id"] == submitted.json()["variant"]["variant_id"]
    assert data["variant_id"] == data["result"]["variant_id"] and data["model_id"] == MODEL

    # The same variant again with another allowed URL: it exists (200), and that URL hears of it too.
    other = receiver.url + "?pipeline=2"
    again = server.client.post(f"/models/{MODEL}/unlearn", json={**body, "callback_url": other})
    assert again.status_code == 200, again.text
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(receiver.deliveries(job_id)) < 2:
        time.sleep(0.05)
    calls = receiver.deliveries(job_id)
    assert len(calls) == 2, calls
    _assert_signed_job(calls[1], job_id)


@pytest.mark.parametrize(
    "url",
    [
        "http://evil.example.com/hook",  # not in the allowlist
        "http://169.254.169.254/latest/meta-data",  # cloud metadata: never
        "http://127.0.0.1:1/hook",  # allowed host, other port
        "http://user:pw@hooks.example.org/hook",  # credentials in the URL
        "ftp://hooks.example.org/hook",  # not http(s)
        "hooks.example.org/hook",  # not absolute
    ],
)
def test_callback_outside_the_allowlist_is_422_and_stores_nothing(server: LiveServer, url: str) -> None:
    name = "cb-refused"
    assert_problem(_concept(server, name, ["some text"], url), 422)
    assert_problem(server.client.get(f"/concepts/{name}"), 404)
    body = {"concepts": ["cb-forget"], "alpha": 0.5, "callback_url": url}
    before = {v["variant_id"] for v in server.client.get("/variants").json()}
    assert_problem(server.client.post(f"/models/{MODEL}/unlearn", json=body), 422)
    assert {v["variant_id"] for v in server.client.get("/variants").json()} == before


def test_a_pending_callback_survives_a_restart(work: Path, model_root: Path, server: LiveServer, receiver: Receiver) -> None:
    """At least once: the outbox is in storage, so a new process delivers what the old one could not."""
    receiver.fail_always = True
    try:
        response = _concept(server, "cb-restart", [f"restart fact {i}" for i in range(6)], receiver.url)
        job_id = response.json()["jobs"][0]["job_id"]
        assert wait_for_job(server.client, job_id)["status"] == "succeeded"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not receiver.deliveries(job_id):
            time.sleep(0.05)
        assert receiver.deliveries(job_id), "the first attempt should have been made"
    finally:
        stop_server(server)  # the module's server is gone from here on
        receiver.fail_always = False
    restarted = _start(work, model_root, receiver)
    try:
        calls = receiver.wait_for(job_id, count=2)
        _assert_signed_job(calls[-1], job_id)
    finally:
        stop_server(restarted)


def test_callback_hosts_without_a_secret_do_not_start() -> None:
    with pytest.raises(ValidationError, match="ENGRAM_CALLBACK_SECRET"):
        Settings(callback_hosts="hooks.example.org")


def test_signature_rejects_stale_timestamps() -> None:
    body = b'{"a":1}'
    old = int(time.time()) - 3600
    headers = {"webhook-id": "j", "webhook-timestamp": str(old), "webhook-signature": sign(SECRET, "j", old, body)}
    assert not verify_signature(SECRET, headers, body)
    assert verify_signature(SECRET, headers, body, tolerance_s=7200)


# ---------------------------------------------------------------- callbacks that cannot jam (issue 23, finding 1)


def _tabbed(receiver: Receiver) -> str:
    """The receiver's URL with a TAB inside its port: ``urlsplit`` drops it (and reads the allowed
    port), httpx refuses the URL. Before issue 23 it passed the allowlist and jammed the outbox."""
    port = str(receiver.port)
    return f"http://127.0.0.1:{port[:2]}\t{port[2:]}/hook"


@pytest.fixture(scope="module")
def jam_server(work: Path, model_root: Path, tiny_llama_dir: Path, receiver: Receiver) -> Iterator[LiveServer]:
    """A server of its own (the module's is stopped by the restart test) that gives up after 3 tries."""
    live = start_server(
        work / "jam-store",
        model_root,
        work / "jam-server.log",
        ENGRAM_CALLBACK_HOSTS=f"127.0.0.1:{receiver.port},hooks.example.org",
        ENGRAM_CALLBACK_SECRET=SECRET,
        ENGRAM_CALLBACK_BACKOFF_S="0.2",
        ENGRAM_CALLBACK_POLL_S="0.2",
        ENGRAM_CALLBACK_MAX_ATTEMPTS="3",
    )
    try:
        register_model(live.client, MODEL, f"file://{tiny_llama_dir}")
        yield live
    finally:
        stop_server(live)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("TABBED", "'\\t' at position"),  # the red team's URL: urlsplit drops the TAB, httpx refuses it
        ("http://hooks.example.org/a\nb", "'\\n' at position"),
        ("http://hooks.example.org/a b", "' ' at position"),
        ("http://hooks.example.org/\x7f", "'\\x7f' at position"),
        ("http://hooks.example.org/\u200b", "'\\u200b' at position"),  # invisible (format) character
        ("http://hooks.example.org:0/hook", "invalid port 0"),  # urlsplit's 0 read as the default 80
        ("http://hooks.ex\u00e4mple.org/hook", "xn--"),  # the client sends the IDNA form: not what was checked
    ],
)
def test_callback_url_that_parsers_read_differently_is_422_and_stores_nothing(
    jam_server: LiveServer, receiver: Receiver, url: str, named: str
) -> None:
    url = _tabbed(receiver) if url == "TABBED" else url
    problem = assert_problem(_concept(jam_server, "cb-unsendable", ["some text"], url), 422, named)
    assert "callback_url" in problem["detail"]
    assert_problem(jam_server.client.get("/concepts/cb-unsendable"), 404)
    assert not (jam_server.storage_dir / "callbacks" / "pending").exists() or not list(
        (jam_server.storage_dir / "callbacks" / "pending").glob("*.json")
    )


def test_a_jammed_outbox_entry_is_dead_lettered_and_later_callbacks_are_delivered(
    jam_server: LiveServer, receiver: Receiver
) -> None:
    """Entries stored before the fix (a URL httpx refuses, an entry that is no object) sort first in
    the outbox; each is dead-lettered with its reason, and a callback queued after them arrives."""
    receiver.fail_first, receiver.fail_always = 0, False
    first = _concept(jam_server, "cb-jam-a", [f"jam fact {i}" for i in range(6)], None)
    job_a = first.json()["jobs"][0]["job_id"]
    assert wait_for_job(jam_server.client, job_a)["status"] == "succeeded"
    pending = jam_server.storage_dir / "callbacks" / "pending"
    pending.mkdir(parents=True, exist_ok=True)
    entry = {"job_id": job_a, "url": _tabbed(receiver), "attempts": 0, "next_attempt_at": 0.0, "last_error": None}
    (pending / "0-jammed.json").write_text(json.dumps(entry))
    (pending / "0-not-an-object.json").write_text("[1, 2]")

    second = _concept(jam_server, "cb-jam-b", [f"later fact {i}" for i in range(6)], receiver.url)
    job_b = second.json()["jobs"][0]["job_id"]
    assert wait_for_job(jam_server.client, job_b)["status"] == "succeeded"
    _assert_signed_job(receiver.wait_for(job_b, count=1)[0], job_b)

    failed = jam_server.storage_dir / "callbacks" / "failed"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(list(failed.glob("0-*.json"))) < 2:
        time.sleep(0.05)
    jammed = json.loads((failed / "0-jammed.json").read_text())
    assert "can never be sent" in jammed["last_error"] and "'\\t'" in jammed["last_error"], jammed
    assert (jammed["job_id"], jammed["url"]) == (job_a, entry["url"])
    assert "not an object" in json.loads((failed / "0-not-an-object.json").read_text())["last_error"]
    assert not list(pending.glob("0-*.json"))
    assert "Traceback" not in jam_server.log_tail(200_000), "a bad entry must be a log line, not a traceback"


def finished_job(job_id: str) -> JobRecord:
    """A succeeded job record under ``job_id`` (the dispatcher alone: no store holds it)."""
    return new_job("map", payload_for("map"), unit="steps").updated(job_id=job_id, status="succeeded")


def test_a_delivery_that_raises_is_retried_then_dead_lettered_and_blocks_nothing(tmp_path: Path, receiver: Receiver) -> None:
    """The dispatcher alone, on real local storage and the real receiver. A transport that raises
    something httpx never would stands in for an unforeseen failure (no real server can make the
    client raise an arbitrary exception); every other URL goes over the real transport."""
    from service.jobs.callbacks import CallbackDispatcher, enqueue
    from service.storage.local import LocalStorage

    class Exploding(httpx.BaseTransport):
        def __init__(self) -> None:
            self.real = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.host == "hooks.example.org":
                raise RuntimeError("the transport broke")
            return self.real.handle_request(request)

    receiver.fail_first, receiver.fail_always = 0, False
    storage = LocalStorage(tmp_path / "store")
    settings = Settings(
        callback_hosts=f"127.0.0.1:{receiver.port},hooks.example.org",
        callback_secret=SECRET,
        callback_max_attempts=2,
        callback_backoff_s=0.05,
    )
    jobs = {j: finished_job(j) for j in ("a-explodes", "b-delivered")}
    dispatcher = CallbackDispatcher(storage, settings, jobs.get, transport=Exploding())
    try:
        enqueue(storage, jobs["a-explodes"], ("http://hooks.example.org/hook",))
        enqueue(storage, finished_job("c-vanished"), (receiver.url,))  # its job record is gone
        enqueue(storage, jobs["b-delivered"], (receiver.url,))
        assert dispatcher.deliver_due() == 1
        assert len(receiver.deliveries("b-delivered")) == 1
        retried = {storage.get_json(k)["job_id"]: storage.get_json(k) for k in storage.list("callbacks/pending/")}
        assert retried.keys() == {"a-explodes", "c-vanished"}
        assert retried["a-explodes"]["attempts"] == 1
        assert retried["a-explodes"]["last_error"] == "RuntimeError: the transport broke"
        assert retried["a-explodes"]["next_attempt_at"] > time.time() - 1  # backoff before the retry
        time.sleep(0.1)
        assert dispatcher.deliver_due() == 0
        assert storage.list("callbacks/pending/") == []
        reasons = {
            storage.get_json(k)["job_id"]: storage.get_json(k)["last_error"] for k in storage.list("callbacks/failed/")
        }
        assert reasons == {
            "a-explodes": "RuntimeError: the transport broke",
            "c-vanished": "job c-vanished no longer exists",
        }
    finally:
        dispatcher.close()  # never started: no thread to stop


def test_slow_receivers_do_not_delay_other_callbacks(tmp_path: Path, receiver: Receiver) -> None:
    """Five entries to a receiver that never answers in time sort before a good one: the good one
    is delivered at once, not after five timeouts (deliveries run ENGRAM_CALLBACK_CONCURRENCY at once)."""
    from service.jobs.callbacks import CallbackDispatcher, enqueue
    from service.storage.local import LocalStorage

    receiver.fail_first, receiver.fail_always, receiver.slow_s = 0, False, 3.0
    storage = LocalStorage(tmp_path / "store")
    settings = Settings(callback_hosts=f"127.0.0.1:{receiver.port}", callback_secret=SECRET, callback_timeout_s=1.0)
    slow = [f"a-slow-{i}" for i in range(5)]
    jobs = {j: finished_job(j) for j in [*slow, "b-prompt"]}
    dispatcher = CallbackDispatcher(storage, settings, jobs.get)
    try:
        for job_id in slow:
            enqueue(storage, jobs[job_id], (f"http://127.0.0.1:{receiver.port}/slow",))
        enqueue(storage, jobs["b-prompt"], (receiver.url,))
        started = time.monotonic()
        passing = threading.Thread(target=dispatcher.deliver_due)
        passing.start()
        receiver.wait_for("b-prompt", count=1, timeout=10)
        assert time.monotonic() - started < 2.5, "the good callback waited behind the slow ones"
        passing.join(timeout=15)
        pending = [storage.get_json(k) for k in storage.list("callbacks/pending/")]
        assert sorted(e["job_id"] for e in pending) == slow
        assert all(e["attempts"] == 1 and "Timeout" in e["last_error"] for e in pending), pending
    finally:
        receiver.slow_s = 0.0
        dispatcher.close()
