"""Prometheus metrics and logs carrying request and job IDs (JSON lines, or text on a terminal).

Metrics are process-local: the API exports its own at ``GET /metrics`` (embedded mode: that
includes the jobs it runs); a distributed worker serves its own on ``ENGRAM_WORKER_METRICS_PORT``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TextIO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pythonjsonlogger.json import JsonFormatter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import ProblemError

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
JOB_ID: ContextVar[str | None] = ContextVar("job_id", default=None)

REQUEST_SECONDS = Histogram(
    "engram_http_request_duration_seconds",
    "HTTP request latency by route template, method and status",
    ["route", "method", "status"],
)
JOB_TRANSITIONS = Counter("engram_jobs_total", "Job state transitions by kind and new state", ["kind", "status"])
COLLECTION_TOKENS = Counter("engram_collection_tokens_total", "Tokens that entered collected statistics")
COLLECTION_RATE = Histogram(
    "engram_collection_tokens_per_second",
    "Throughput of each finished collection (counted tokens per second)",
    buckets=(10, 100, 1e3, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7),
)
# "mostrecent": in multiprocess mode (embedded jobs in their own process) the last value set wins.
QUEUE_DEPTH = Gauge("engram_queue_depth", "Jobs waiting to run, by queue", ["queue"], multiprocess_mode="mostrecent")
# Universe storage: set at scrape time from storage itself (service.universes.retention.refresh_metrics),
# so they hold whichever process built or evicted what; "mostrecent" keeps the scraping process's values.
UNIVERSE_BYTES = Gauge(
    "engram_universe_bytes",
    "Bytes stored by universes, by part: groups (pseudo-inverse factors) and engrams; reserved: projected bytes "
    "of builds still running beyond what they stored so far",
    ["part"],
    multiprocess_mode="mostrecent",
)
UNIVERSE_BUDGET = Gauge(
    "engram_universe_budget_bytes", "ENGRAM_UNIVERSE_BYTES_BUDGET (0: no limit)", multiprocess_mode="mostrecent"
)
UNIVERSES = Gauge("engram_universes", "Universes by status", ["status"], multiprocess_mode="mostrecent")
UNIVERSE_EVICTIONS = Counter(
    "engram_universe_evictions_total", "Universes deleted by the retention rule: to make room, or expired", ["reason"]
)
UNIVERSE_REFUSALS = Counter(
    "engram_universe_budget_refusals_total", "Universe requests refused because they would exceed the budget"
)


def record_job_state(kind: str, status: str) -> None:
    JOB_TRANSITIONS.labels(kind=kind, status=status).inc()


def record_collection(tokens: int, seconds: float) -> None:
    COLLECTION_TOKENS.inc(tokens)
    if seconds > 0:
        COLLECTION_RATE.observe(tokens / seconds)


def refresh_queue_depth(depths: Callable[[], dict[str, int]]) -> None:
    """Set the queue gauges from the current depths (read at scrape time)."""
    for queue, depth in depths().items():
        QUEUE_DEPTH.labels(queue=queue).set(depth)


def set_universe_gauges(*, groups: int, engrams: int, reserved: int, budget: int, statuses: dict[str, int]) -> None:
    """Set the universe storage gauges (from a read of storage, at scrape time)."""
    UNIVERSE_BYTES.labels(part="groups").set(groups)
    UNIVERSE_BYTES.labels(part="engrams").set(engrams)
    UNIVERSE_BYTES.labels(part="reserved").set(reserved)
    UNIVERSE_BUDGET.set(budget)
    for status, count in statuses.items():
        UNIVERSES.labels(status=status).set(count)


def record_universe_eviction(reason: str) -> None:
    UNIVERSE_EVICTIONS.labels(reason=reason).inc()


def record_universe_refusal() -> None:
    UNIVERSE_REFUSALS.inc()


def exposition() -> bytes:
    """This service's metrics in the Prometheus text format.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``engram-service serve`` in embedded mode sets it, since
    jobs run in a child process; a worker sets it for its pool), the values of every process of the
    service are gathered from that folder; otherwise this process's own.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()


@contextmanager
def job_context(job_id: str) -> Iterator[None]:
    """Log records emitted while a job runs carry its ID."""
    token = JOB_ID.set(job_id)
    try:
        yield
    finally:
        JOB_ID.reset(token)


class RequestContext:
    """ASGI middleware: a request ID (``X-Request-ID`` in, or a new one) for logs and the response,
    and the latency histogram by route template (not raw path: IDs would explode the labels)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        undecodable = _header_not_utf8(scope["headers"])
        headers = {} if undecodable else {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        request_id = headers.get("x-request-id", "")[:64] or uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        started, status = time.perf_counter(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            if undecodable:
                await _refuse_header(undecodable, scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            REQUEST_SECONDS.labels(route=route, method=scope["method"], status=str(status)).observe(
                time.perf_counter() - started
            )
            REQUEST_ID.reset(token)


class MalformedHeader(ProblemError):
    status, title, slug = 400, "Malformed header", "malformed-header"


def _header_not_utf8(raw: list[tuple[bytes, bytes]]) -> str | None:
    """The name of the first header whose bytes are not UTF-8 text, if any.

    HTTP lets a header carry any byte above 0x7F; nothing this service reads is meant to, and
    every layer after this one (the request ID, the size limit, the routes) reads headers as text:
    refused here, once, before anything can fail on them.
    """
    for name, value in raw:
        try:
            name.decode()
            value.decode()
        except UnicodeDecodeError:
            return name.decode("ascii", "backslashreplace")
    return None


async def _refuse_header(name: str, scope: Scope, receive: Receive, send: Send) -> None:
    problem = MalformedHeader(f"the {name} header is not UTF-8 text: send header values as ASCII or UTF-8")
    body = json.dumps(problem.to_problem().model_dump(mode="json")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": problem.status,
            "headers": [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.job_id = JOB_ID.get()
        return True


_POLLED_PREFIXES = ("/healthz", "/readyz", "/metrics", "/jobs/", "/concepts/", "/variants/")


def _writes_text(log_format: str, stream: TextIO) -> bool:
    """Text for "text", or for "auto" on a terminal; JSON otherwise (a container's stderr is no TTY)."""
    if log_format == "auto":
        return stream.isatty()
    return log_format == "text"


def _json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s %(job_id)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


class _TextFormatter(logging.Formatter):
    """``time level logger: message``, then the request or job the line belongs to, if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{key}={value}" for key in ("request_id", "job_id") if (value := getattr(record, key, None))]
        return f"{line} [{' '.join(ids)}]" if ids else line


def _text_formatter() -> logging.Formatter:
    return _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


class _QuietPolls(logging.Filter):
    """Drops the access-log line of a successful status poll (hundreds a second under heavy
    polling; the latency histogram still counts each). Errors, writes and downloads are logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn: client, method, path, version, status
            return True
        _client, method, path, _version, status = args
        polled = method == "GET" and str(path).startswith(_POLLED_PREFIXES) and "/files/" not in str(path)
        return not (polled and isinstance(status, int) and status < 400)


def _no_progress_bars() -> None:
    """No tqdm bars between JSON lines (issue 40: "Loading weights" and "Writing model shards" bars ended up
    inside the JSON logs, where a log shipper reads them as broken lines). The variable reaches the job
    processes spawned later (huggingface_hub reads it when imported, and transformers follows it); a
    library this process imported already is told directly."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def configure_logging(level: int = logging.INFO, log_format: str | None = None) -> None:
    """Log lines on stderr for the service, uvicorn and Celery alike: one JSON object per line, or
    plain ``time level logger: message`` lines for a person at a terminal.

    Args:
        level: the root logger's level.
        log_format: "json", "text" or "auto" (text when stderr is a terminal); None: ENGRAM_LOG_FORMAT.
    """
    if log_format is None:
        from service.config import get_settings

        log_format = get_settings().log_format
    handler = logging.StreamHandler()
    as_text = _writes_text(log_format, handler.stream)
    handler.setFormatter(_text_formatter() if as_text else _json_formatter())
    if not as_text:
        _no_progress_bars()
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _QuietPolls) for f in access.filters):
        access.addFilter(_QuietPolls())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
