"""A running job's progress counter and its cancellation check, shared by every job body."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

_PROGRESS_EVERY_S = 1.0


class JobCancelled(RuntimeError):
    pass


class Progress(Protocol):
    """What a job body's steps report to: one step done (raises :class:`JobCancelled` when asked to stop)."""

    def advance(self, amount: int = 1) -> None: ...


class ProgressReporter:
    """Throttled progress reporting plus the cancellation check, shared by every job kind.

    It writes the job record's progress (:class:`api_schemas.jobs.JobProgress`, what the API
    answers); this is what reports to it, hence another name."""

    def __init__(self, ctx: Any, job_id: str, total: int) -> None:
        self.ctx, self.job_id, self.done, self.total = ctx, job_id, 0, total
        self._last = 0.0
        ctx.jobs.update(job_id, progress={**ctx.jobs.get(job_id).progress.model_dump(), "done": 0, "total": total})

    def advance(self, amount: int = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self._last >= _PROGRESS_EVERY_S or self.done >= self.total:
            self._last = now
            self.ctx.jobs.set_progress(self.job_id, self.done, self.total)
        if self.cancelled():
            raise JobCancelled()

    def restart(self, total: int) -> None:
        """Count again from zero towards ``total`` (a job's next phase)."""
        self.done, self.total, self._last = 0, total, 0.0
        self.ctx.jobs.set_progress(self.job_id, 0, total)

    def cancelled(self) -> bool:
        job = self.ctx.jobs.get(self.job_id)
        return bool(job and job.cancel_requested)


class CancelOnly:
    """Checks cancellation at every step without counting: work a job does before what its
    progress counts (a variant building its universe first)."""

    def __init__(self, progress: ProgressReporter) -> None:
        self._progress = progress

    def advance(self, amount: int = 1) -> None:
        if self._progress.cancelled():
            raise JobCancelled()


class NoProgress:
    """Nobody listens (the bench, tests)."""

    def advance(self, amount: int = 1) -> None:
        return None


class StepTimes:
    """Seconds a job spent in each of its named steps, in the order they first ran.

    A job's result reports them (``result.steps``) so that what a user waits for can be split into
    its parts from the outside (``bench.e2e``): a step that runs twice adds up.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - started, 4)
