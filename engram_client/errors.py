"""The errors of :class:`~engram_client.EngramClient`: one family, :class:`EngramError`, so a caller
can catch everything the client raises at once, or one kind of failure by its class."""

from __future__ import annotations

from typing import Any

import httpx

from api_schemas import Job

__all__ = [
    "EngramAPIError",
    "EngramConnectionError",
    "EngramDownloadError",
    "EngramError",
    "EngramJobError",
    "EngramOutputExistsError",
    "EngramTimeoutError",
]


class EngramError(Exception):
    """Base of every error the client raises."""


class EngramAPIError(EngramError):
    """The service answered with an error status.

    Attributes:
        status: the HTTP status code.
        title: the problem's short summary (e.g. ``Not found``).
        detail: what exactly was wrong with the request.
        problem: the whole problem+json body (``type``, ``title``, ``status``, ``detail``, ``errors``?).
    """

    def __init__(self, status: int, title: str, detail: str, problem: dict[str, Any]) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status, self.title, self.detail, self.problem = status, title, detail, problem

    @classmethod
    def from_response(cls, response: httpx.Response) -> EngramAPIError:
        """Parse a problem+json answer; anything else (a proxy's HTML page) keeps its status and a text excerpt."""
        problem: dict[str, Any] = {}
        try:
            body = response.json()
            if isinstance(body, dict):
                problem = body
        except ValueError:
            pass
        status = int(problem.get("status") or response.status_code)
        title = str(problem.get("title") or response.reason_phrase or "HTTP error")
        detail = str(problem.get("detail") or response.text[:500].strip() or f"{response.request.method} {response.url}")
        return cls(status, title, detail, problem or {"status": status, "title": title, "detail": detail})


class EngramConnectionError(EngramError):
    """The service could not be reached (refused, DNS, TLS, timeout) after the retries.

    Attributes:
        timed_out: the service was reached but did not answer within the client's timeout.
    """

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class EngramDownloadError(EngramError):
    """A downloaded file's size or sha256 differs from the variant's manifest; nothing was written."""


class EngramOutputExistsError(EngramError, FileExistsError):
    """The download directory exists with other content; it is never merged into, only replaced on request."""


class EngramTimeoutError(EngramError, TimeoutError):
    """A wait for a job or variant ran past its timeout (the job itself keeps running)."""


class EngramJobError(EngramError):
    """A job the caller waited for failed or was cancelled.

    Attributes:
        job: the finished job; ``job.error`` is its problem, when it has one.
    """

    def __init__(self, job: Job) -> None:
        reason = f"{job.error.title}: {job.error.detail}" if job.error else "no error was recorded"
        super().__init__(f"{job.kind} job {job.job_id} {job.status}: {reason}")
        self.job = job


class _Transient(Exception):
    """An answer worth retrying (503); carries the error to raise when the retries run out."""

    def __init__(self, error: EngramAPIError, retry_after: float) -> None:
        super().__init__(str(error))
        self.error, self.retry_after = error, retry_after
