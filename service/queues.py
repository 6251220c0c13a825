"""Distributed mode's queues: which Celery task and queue runs each job kind, and the Celery app.

Here, not in :mod:`workers.celery_app`, so that the API process sends tasks without importing the
worker module (which builds its runtime from :mod:`service.runtime`: importing it back was a cycle).
Queue ``gpu``: the model runs and whatever costs far more than a copy; ``cpu``: arithmetic builds.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from service.config import Settings

__all__ = ["TASK_FOR_KIND", "UNIVERSE_HELPER", "make_celery"]

TASK_FOR_KIND = {
    "collect": ("engram.collect", "gpu"),
    "variant": ("engram.build_variant", "cpu"),
    # A universe costs far more than a copy (float64 eigh and W·Σ_k·Σ_U⁺ products): GPU workers take it.
    "universe": ("engram.build_universe", "gpu"),
    "evaluate": ("engram.evaluate", "gpu"),
    "generate": ("engram.generate", "gpu"),
    "calibrate": ("engram.calibrate", "gpu"),
}
# A universe build's helpers run where its job runs (service.universes.build: parts claimed by lease).
UNIVERSE_HELPER = ("engram.help_universe", TASK_FOR_KIND["universe"][1])


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
        task_queues=[Queue("gpu"), Queue("cpu")],
        task_default_queue="cpu",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,  # the job record is the result; Celery's would be a second copy
    )
    return app
