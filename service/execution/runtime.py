"""Wiring of one process: storage, job store, dispatcher and background duties, per mode.

Embedded (no broker): jobs run in one child process (``service.execution.embedded``), their live records in a
SQLite file both processes share; at start-up, jobs interrupted by a restart run again.
Distributed (``ENGRAM_BROKER_URL=redis://…``): jobs live in Redis, run in Celery workers, and a
reconciler re-dispatches anything Redis or a worker lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from service.config import Settings
from service.context import Context
from service.execution.embedded import ProcessExecutor, SqliteJobStore, live_store_path
from service.execution.kinds import Duty, duties
from service.jobs.callbacks import CallbackDispatcher
from service.jobs.store import RedisJobStore
from service.storage.factory import open_storage
from service.storage.janitor import start_janitor

log = logging.getLogger("engram.runtime")


@dataclass
class Runtime:
    """A process's context and the background duties it starts and stops."""

    ctx: Context
    on_start: list[Callable[[], None]] = field(default_factory=list)
    on_stop: list[Callable[[], None]] = field(default_factory=list)

    def start(self) -> None:
        for step in self.on_start:
            step()

    def stop(self) -> None:
        for step in self.on_stop:
            step()


def build_runtime(settings: Settings, *, background: bool = True) -> Runtime:
    """The runtime of an API process (``background``) or of a worker (no background duties)."""
    runtime = _embedded(settings) if settings.embedded else _distributed(settings, background)
    ctx = runtime.ctx
    # Crashed processes' leftovers; an API process also runs the periodic duties (the universes' retention rule).
    periodic = partial(_run_duties, ctx, duties()) if background else None

    def janitor() -> None:
        start_janitor(settings, ctx.storage, periodic)

    runtime.on_start.insert(0, janitor)
    return runtime


def _embedded(settings: Settings) -> Runtime:
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    jobs = SqliteJobStore(storage, live_store_path(settings))
    executor = ProcessExecutor(settings, jobs)
    ctx = Context(settings=settings, storage=storage, jobs=jobs, dispatch=executor.submit, lock=threading.RLock())
    ctx.queue_depths = executor.depths
    ctx.job_process_warm = executor.warm

    def requeue_interrupted() -> None:
        jobs.prune()
        for job in ctx.jobs.unfinished():  # tasks are idempotent: running one again is harmless
            log.info("re-queueing interrupted job %s", job.job_id)
            ctx.jobs.update(job.job_id, status="queued")
            executor.submit(job)

    runtime = Runtime(ctx, on_start=[executor.start, requeue_interrupted], on_stop=[executor.shutdown])
    _deliver_callbacks(runtime, lock=None)
    executor.on_finished = jobs.on_finished  # the job process's finished jobs wake the dispatcher too
    return runtime


def _distributed(settings: Settings, background: bool) -> Runtime:
    # Imported here: embedded mode, the default, runs without Redis and Celery.
    import redis

    from service.execution.queues import QUEUES, CelerySender, make_celery
    from service.jobs.presence import live_workers
    from service.jobs.reconcile import reconcile_once, reconciler

    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    assert settings.broker_url is not None, "distributed mode is the mode with a broker"
    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=10)
    jobs = RedisJobStore(storage, client, settings.heartbeat_ttl_s)
    sender = CelerySender(make_celery(settings), jobs)
    # One registry lock for every API process: concurrent identical requests create one job.
    lock = client.lock("engram:lock:registry", timeout=120, blocking_timeout=60)
    ctx = Context(
        settings=settings,
        storage=storage,
        jobs=jobs,
        dispatch=sender.dispatch,
        lock=lock,
        broker_ping=client.ping,
        universe_helpers=partial(sender.helpers, "universe"),
        # Celery's Redis transport keeps each queue as a list named after it.
        queue_depths=lambda: {queue: int(client.llen(queue)) for queue in QUEUES},
        live_workers=lambda: live_workers(client, QUEUES),  # /readyz: no consumer, not ready
    )
    runtime = Runtime(ctx)
    if background:
        dispatch = sender.dispatch
        reconciling = reconciler(jobs, dispatch, settings.reconcile_interval_s)
        runtime.on_start += [lambda: _safely(lambda: reconcile_once(jobs, dispatch)), reconciling.start]
        runtime.on_stop.append(reconciling.stop)
        # Workers only write outbox entries; the API processes deliver them, one at a time.
        _deliver_callbacks(runtime, lock=lambda: client.lock("engram:lock:callbacks", timeout=300))
    return runtime


def _deliver_callbacks(runtime: Runtime, lock: Callable[[], Any] | None) -> None:
    """Start this API process's callback dispatcher with the runtime (and stop it with it)."""
    ctx = runtime.ctx
    dispatcher = CallbackDispatcher(ctx.storage, ctx.settings, ctx.jobs.get, lock=lock)
    ctx.jobs.on_finished = dispatcher.wake
    runtime.on_start.append(dispatcher.start)
    runtime.on_stop.insert(0, dispatcher.stop)


def _run_duties(ctx: Context, steps: list[Duty]) -> list[str]:
    """One periodic pass: each duty in turn; what they removed (the janitor logs it, and a failure)."""
    return [removed for step in steps for removed in step(ctx)]


def _safely(step: Callable[[], Any]) -> None:
    try:
        step()
    except Exception as exc:  # a start-up pass must not keep the API down; the loop tries again
        log.warning("start-up reconcile pass failed: %s", exc)
