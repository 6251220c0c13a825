"""Errors that carry their own HTTP status; the API renders each as application/problem+json."""

from __future__ import annotations

from typing import Any


class ProblemError(Exception):
    """Base of every user-facing error.

    Attributes:
        status: the HTTP status code.
        title: a short, stable summary of the problem type.
        detail: what exactly is wrong with this request.
    """

    status = 400
    title = "Bad request"
    slug = "bad-request"

    def __init__(
        self, detail: str, *, errors: list[dict[str, Any]] | None = None, extensions: dict[str, Any] | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors
        # RFC 9457 extension members a client can act on (close matches, the job to follow); the
        # detail says the same in words, so a client that shows only the detail loses nothing.
        self.extensions = extensions or {}

    @property
    def type(self) -> str:
        return f"https://engram.dev/problems/{self.slug}"

    def to_problem(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type, "title": self.title, "status": self.status, "detail": self.detail}
        if self.errors:
            body["errors"] = self.errors
        return {**self.extensions, **body}


class InvalidInput(ProblemError):
    status, title, slug = 422, "Invalid input", "invalid-input"


class MalformedBody(ProblemError):
    """The body cannot be read at all: not JSON, not UTF-8, nested too deeply, a broken JSONL line."""

    status, title, slug = 400, "Malformed body", "malformed-body"


class NotFound(ProblemError):
    status, title, slug = 404, "Not found", "not-found"


class Conflict(ProblemError):
    status, title, slug = 409, "Conflict", "conflict"


class PayloadTooLarge(ProblemError):
    status, title, slug = 413, "Payload too large", "payload-too-large"


class Unauthorized(ProblemError):
    status, title, slug = 401, "Unauthorized", "unauthorized"


class Forbidden(ProblemError):
    status, title, slug = 403, "Forbidden", "forbidden"


class ServiceUnavailable(ProblemError):
    status, title, slug = 503, "Service unavailable", "service-unavailable"


class JobFailed(ProblemError):
    """A job failed for a reason the user can act on (bad model, non-finite edit, ...)."""

    status, title, slug = 422, "Job failed", "job-failed"


def first_validation_error(exc: Any) -> str:
    """A pydantic ``ValidationError``'s first error as ``field.path: message``: what a refusal of a
    stored record says about why it cannot be read."""
    error = exc.errors()[0]
    return f"{'.'.join(map(str, error['loc']))}: {error['msg']}"
