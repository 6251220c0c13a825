"""Jobs: read, list, cancel and wait for them; how a call that starts a job submits it and waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx

from api_schemas import JOB_MODELS, Job
from engram_client.errors import EngramError, EngramJobError, EngramTimeoutError
from engram_client.transport import FINISHED, Page, Transport, _quote

# How long the service may hold a map or a remote registration for its job before answering 202.
JOB_HOLD_S = 20.0

ProgressCallback = Callable[[Job], None]
KindJob = TypeVar("KindJob", bound=Job)


class JobsResource(Transport):
    """``/jobs``, and the submit-and-wait of every call that starts a job (evaluate, a map, a registration)."""

    def get_job(self, job_id: str) -> Job:
        """A job's status and progress; an ``evaluate``, ``generate`` or ``calibrate`` job as the model of
        its kind (:data:`api_schemas.JOB_MODELS`), whose ``result`` is typed."""
        return _job(self._request("GET", f"/jobs/{_quote(job_id)}"))

    def list_jobs(
        self, status: Sequence[str] | None = None, *, limit: int | None = None, cursor: str | None = None
    ) -> Page[Job]:
        """The jobs not finished yet, oldest first; ``status`` (``queued``, ``running``) narrows them.
        All of them, or one page with ``limit``/``cursor`` (see :meth:`_list`)."""
        params = {"status": list(status)} if status else None
        return self._list(Job, "/jobs", params, limit, cursor)

    def cancel_job(self, job_id: str) -> Job:
        """Cancel a job: a queued one at once, a running one at its next checkpoint."""
        return _job(self._request("DELETE", f"/jobs/{_quote(job_id)}"))

    def wait_for_job(
        self,
        job_id: str,
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> Job:
        """Poll a job until it succeeded, failed or was cancelled, and return it (whatever its status).

        Args:
            on_progress: called with the job after every poll, the finished job included.
            poll_s: seconds between polls.
            timeout: give up after this many seconds (``None``: wait as long as it takes).

        Raises:
            EngramTimeoutError: the timeout passed; the job keeps running on the service.
        """
        return self.wait_for_jobs([job_id], on_progress, poll_s, timeout)[0]

    def wait_for_jobs(
        self,
        job_ids: Sequence[str],
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> list[Job]:
        """:meth:`wait_for_job` for several jobs at once (a concept collected on several models); same order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        latest: dict[str, Job] = {}
        while True:
            for job_id in job_ids:
                if job_id not in latest or latest[job_id].status not in FINISHED:
                    latest[job_id] = self.get_job(job_id)
                    if on_progress is not None:
                        on_progress(latest[job_id])
            if all(job.status in FINISHED for job in latest.values()):
                return [latest[job_id] for job_id in job_ids]
            if deadline is not None and time.monotonic() > deadline:
                running = [j for j, job in latest.items() if job.status not in FINISHED]
                raise EngramTimeoutError(f"jobs {', '.join(running)} did not finish within {timeout}s")
            time.sleep(poll_s)

    def _submit_job(
        self,
        model: type[KindJob],
        path: str,
        body: dict[str, Any],
        wait_s: float,
        wait: bool,
        on_progress: ProgressCallback | None,
        poll_s: float,
        timeout: float | None,
    ) -> KindJob:
        """POST a job of ``model``'s kind (never retried); with ``wait``, poll it to the end and raise unless
        it succeeded."""
        options: dict[str, Any] = {}
        if wait_s:  # the service holds its answer up to wait_s: the read timeout must outlast the hold
            options = {"params": {"wait": wait_s}, "timeout": httpx.Timeout(self.timeout, read=self.timeout + wait_s)}
        job = _of_kind(model, _job(self._request("POST", path, json=body, **options)))
        if not wait:
            return job
        if job.status not in FINISHED:
            job = _of_kind(model, self.wait_for_job(job.job_id, on_progress, poll_s, timeout))
        elif on_progress is not None:
            on_progress(job)  # the caller hears of the end in every case
        if job.status != "succeeded":
            raise EngramJobError(job)
        return job

    def _answer_after_job(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send a request the service answers once a job did the work (a map, a remote registration):
        the service holds its answer up to :data:`JOB_HOLD_S` seconds, then answers 202 with the job;
        this waits for that job and asks again (its answer is then stored)."""
        params = {**kwargs.pop("params", {}), "wait": JOB_HOLD_S}
        held = httpx.Timeout(self.timeout, read=self.timeout + JOB_HOLD_S)  # the read outlasts the hold
        response = self._request(method, path, params=params, timeout=held, **kwargs)
        if response.status_code != 202:
            return response
        job = self.wait_for_job(_job(response).job_id)
        if job.status != "succeeded":
            raise EngramJobError(job)
        return self._request(method, path, params=params, timeout=held, **kwargs)


def _job(response: httpx.Response) -> Job:
    """The job answered, as the model of its kind, or as :class:`~api_schemas.Job` for a kind whose result
    has no model of its own."""
    data = response.json()
    return JOB_MODELS.get(data.get("kind"), Job).model_validate(data)


def _of_kind(model: type[KindJob], job: Job) -> KindJob:
    if not isinstance(job, model):
        raise EngramError(f"expected a {model.__name__}, the service answered a {job.kind} job ({job.job_id})")
    return job
