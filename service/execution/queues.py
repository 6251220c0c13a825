"""Distributed mode's queues: the Celery app, and the sender that puts a job on its kind's queue.

Which Celery task and queue run each job kind is :data:`service.execution.kinds.KINDS`; the worker's
tasks (:mod:`workers.celery_app`) are registered from the same table, so a sender and a worker
cannot disagree. Queue ``gpu``: the model runs and whatever costs far more than a copy; ``cpu``:
arithmetic builds.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from service.config import Settings
from service.execution.kinds import HELPERS, KINDS
from service.jobs.records import JobKind, JobRecord, VariantPayload
from service.jobs.store import RedisJobStore

QUEUES = sorted({kind.queue for kind in KINDS.values()})


def make_celery(settings: Settings) -> Celery:
    """A Celery app configured from settings (the API uses it to send, workers to run)."""
    app = Celery("engram", broker=settings.broker_url, backend=settings.broker_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_time_limit=settings.task_hard_limit_s,
        task_soft_time_limit=settings.task_soft_limit_s,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        result_expires=24 * 3600,
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue="cpu",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,  # the job record is the result; Celery's would be a second copy
    )
    return app


class CelerySender:
    """Sends jobs, and the helpers of a running job, to the queues."""

    def __init__(self, celery: Celery, jobs: RedisJobStore) -> None:
        self.celery, self.jobs = celery, jobs

    def dispatch(self, job: JobRecord) -> None:
        kind = KINDS[job.kind]
        # A variant that must build its universe first: gpu.
        queue = (job.payload.queue if isinstance(job.payload, VariantPayload) else None) or kind.queue
        # The epoch tells the reconciler later whether this message could have died with Redis.
        self.jobs.update(job.job_id, persist=False, dispatch_epoch=self.jobs.epoch())
        self.celery.send_task(kind.task, kwargs={"job_id": job.job_id}, queue=queue)

    def helpers(self, kind: JobKind, subject_id: str, job_id: str, count: int) -> None:
        """Ask ``count`` idle workers to help job ``job_id`` of ``kind`` with ``subject_id``.

        Not jobs: messages any idle worker of the kind's queue may take (a universe's helpers claim
        parts by lease, so two never compute one part)."""
        helper = HELPERS[kind]
        kwargs = {helper.subject: subject_id, "job_id": job_id}
        for _ in range(count):
            self.celery.send_task(helper.task, kwargs=kwargs, queue=KINDS[kind].queue)
