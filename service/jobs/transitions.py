"""Which changes a job record takes: the rule every job store applies inside its compare-and-set.

A job moves ``queued`` → ``running`` → ``succeeded`` | ``failed`` | ``cancelled`` (and back to
``queued`` from ``running`` for a retry, or when its worker died). Its end is final: once a job has
finished, its status, result, error, progress and timestamps never change again, so no reader ever
sees a final state that it then leaves. Writers that come late are expected, not bugs: a progress
tick or a cancel check racing the job's end, a worker whose heartbeat expired and whose job another
worker finished, a DELETE racing a success. Their change is refused and the record left as it is.
The service has no path that runs a finished job again: posting the same work again makes a new job.

The one change a finished job takes is new callback URLs (a repeated request attaching to it:
:func:`service.jobs.submit.attach_callbacks` then delivers to them at once).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from service.jobs.records import JobRecord

FINISHED = frozenset({"succeeded", "failed", "cancelled"})
# What a finished job still takes: who hears of its end.
_OPEN_AFTER_THE_END = frozenset({"callbacks"})
log = logging.getLogger("engram.jobs")


def next_record(job: JobRecord, fields: Mapping[str, Any], expect: Collection[str] | None) -> JobRecord | None:
    """``job`` with ``fields`` set, or None when the change is refused (``job`` then stays as it is).

    Args:
        job: the record as the store holds it now (read inside its compare-and-set).
        fields: the fields to set (checked as :meth:`JobRecord.updated` checks them).
        expect: the statuses ``job`` must be in for the change to apply; None: any.

    Returns:
        The new record (equal to ``job`` when the fields change nothing: the caller may still
        persist it), or None: ``job`` is not in an expected status, or it has finished and the
        change would touch more than its callbacks.
    """
    if expect is not None and job.status not in expect:
        return None
    changed = job.updated(**fields)
    if job.status in FINISHED:
        touched = sorted(
            name for name in fields if name not in _OPEN_AFTER_THE_END and getattr(changed, name) != getattr(job, name)
        )
        if touched:
            # A progress tick past the end is routine (a body's last count racing its end): not worth a warning.
            log.log(
                logging.DEBUG if touched == ["progress"] else logging.WARNING,
                "job %s %s: a late change of its %s was refused (a finished job keeps its outcome)",
                job.job_id,
                job.status,
                ", ".join(touched),
                extra={"refused_fields": touched, "job_status": job.status},
            )
            return None
    return changed
