"""``engram-service serve | worker | migrate``."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engram-service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP API (with the in-process worker when no broker is set)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    worker = sub.add_parser("worker", help="run a Celery worker (distributed mode; uses CUDA when present)")
    worker.add_argument("--queues", default="gpu,cpu", help="comma-separated queues to consume (default gpu,cpu)")
    migrate = sub.add_parser(
        "migrate",
        help="rewrite the store's records of an older version in the current format (run with the service stopped)",
    )
    migrate.add_argument("--dry-run", action="store_true", help="report what would change; write nothing")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args.host, args.port)
    if args.command == "migrate":
        return _migrate(dry_run=args.dry_run)
    return _worker(args.queues)


def _migrate(*, dry_run: bool) -> int:
    """Migrate the store of ENGRAM_STORAGE_URL; prints each record changed and each refused.

    Returns:
        0 when every record is current now, 1 when some were refused (they are left as they were).
    """
    import threading

    from service.config import get_settings
    from service.context import Context
    from service.jobs.store import JobStore
    from service.storage.factory import open_storage
    from service.variants.migrate import migrate_store

    settings = get_settings()
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)

    def no_jobs(job: object) -> None:
        raise RuntimeError("migrate starts no job")

    ctx = Context(settings=settings, storage=storage, jobs=JobStore(storage), dispatch=no_jobs, lock=threading.RLock())
    done = migrate_store(ctx, dry_run=dry_run)
    verb = "would migrate" if dry_run else "migrated"
    for key, what in done.changed:
        print(f"{verb} {key}: {what}")  # noqa: T201
    for key, why in done.refused:
        print(f"refused {key}: {why}", file=sys.stderr)  # noqa: T201
    print(f"{len(done.changed)} record(s) {verb}, {len(done.refused)} refused", file=sys.stderr)  # noqa: T201
    return 1 if done.refused else 0


def _worker(queues: str) -> int:
    from service.config import get_settings

    settings = get_settings()
    if settings.embedded:
        print("engram-service worker needs ENGRAM_BROKER_URL=redis://host:port/db", file=sys.stderr)  # noqa: T201
        return 2
    if settings.worker_metrics_port:
        _serve_worker_metrics(settings.worker_metrics_port)
    from service.observability import configure_logging
    from workers.celery_app import app

    configure_logging()
    # One task at a time, one message prefetched: a GPU holds one model, and a message waiting
    # behind a long collection would be better served by another worker.
    app.worker_main(
        [
            "worker",
            "--queues",
            queues,
            "--concurrency",
            "1",
            "--prefetch-multiplier",
            "1",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--hostname",
            "engram@%h",
            "--task-events",
        ]  # Flower and `celery events` see tasks, not only workers
    )
    return 0


def _serve_worker_metrics(port: int) -> None:
    """Tasks run in the pool's child processes, so their metrics are gathered in prometheus
    multiprocess mode: the variable must be set before prometheus_client is first imported."""
    import os
    import tempfile

    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="engram-metrics-"))
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(port, registry=registry)


def _serve(host: str, port: int) -> int:
    if _port_in_use(host, port):  # said before anything starts: uvicorn would say it as a JSON log line
        print(f"port {port} is in use: pass PORT=<n> to make run (or --port)", file=sys.stderr)  # noqa: T201
        return 1
    from service.config import get_settings

    settings = get_settings()
    if settings.embedded:  # jobs run in a child process: its metrics must reach this one's /metrics
        _gather_metrics_across_processes()
    import uvicorn

    from service.api.app import create_app
    from service.api.header_limit import header_limited_protocol
    from service.observability import configure_logging

    configure_logging()
    if settings.api_keys is None:
        logging.getLogger("engram").warning("ENGRAM_API_KEYS is unset: the API accepts requests without auth")
    # The head of a request is capped in the server's protocol: the app is called only once it is buffered.
    protocol = header_limited_protocol(settings.max_header_bytes)
    uvicorn.run(create_app(settings), host=host, port=port, log_config=None, http=protocol)
    return 0


def _port_in_use(host: str, port: int) -> bool:
    """Whether another process listens on ``host:port`` (bound as uvicorn binds: SO_REUSEADDR)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, port), family=family):
            return False
    except OSError as exc:  # another error (an unknown host) is left for uvicorn to report
        return exc.errno == errno.EADDRINUSE


def _gather_metrics_across_processes() -> None:
    """Prometheus multiprocess mode, set before prometheus_client is first imported; the folder
    is this service's own and goes with it."""
    import atexit
    import os
    import shutil
    import tempfile

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    folder = tempfile.mkdtemp(prefix="engram-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
