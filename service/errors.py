"""Errors that carry their own HTTP status; the API renders each as application/problem+json."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, SerializerFunctionWrapHandler, model_serializer, model_validator
from pydantic import ValidatorFunctionWrapHandler as _Validate


class ProblemDetails(BaseModel):
    """An RFC 9457 problem as a record: what :meth:`ProblemError.to_problem` gives, what a failed job
    stores (:attr:`service.jobs.records.JobRecord.error`) and what the API answers as
    ``application/problem+json``.

    Extension members (``close_matches``, ``jobs``, a budget's figures, ...) are kept as extra fields.
    It dumps exactly the members it was given, in the order they were given (what the JSON answered and
    stored before it was a model, byte for byte): a member left out stays out, a member given as null
    stays null.
    """

    model_config = ConfigDict(frozen=True, extra="allow")

    type: str
    title: str
    status: int
    detail: str
    errors: list[dict[str, Any]] | None = None
    _order: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: _Validate) -> ProblemDetails:
        problem: ProblemDetails = handler(data)
        if isinstance(data, dict):
            problem._order = tuple(data)
        return problem

    @model_serializer(mode="wrap")
    def _in_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        members: dict[str, Any] = handler(self)
        given = self.model_fields_set | set(self.model_extra or ())
        order = self._order or tuple(name for name in members if name in given)
        return {name: members[name] for name in order if name in members}

    def with_members(self, **members: Any) -> ProblemDetails:
        """This problem with ``members`` set (a given one replaced where it stands, a new one last)."""
        return ProblemDetails.model_validate({**self.model_dump(mode="json"), **members})


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
    headers: dict[str, str] | None = None  # HTTP headers its answer carries (Retry-After on a 429)

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

    def to_problem(self) -> ProblemDetails:
        """The problem (its extension members first, as the API always answered them)."""
        body: dict[str, Any] = {"type": self.type, "title": self.title, "status": self.status, "detail": self.detail}
        if self.errors:
            body["errors"] = self.errors
        return ProblemDetails.model_validate({**self.extensions, **body})


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
