"""What every part of the wire contract shares: the strict base model, problems, name patterns and paging."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MODEL_ID_PATTERN = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)?$"
CONCEPT_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
# The schemes service.sources accepts (urlparse lower-cases the scheme, so any case does).
SOURCE_PATTERN = r"^([Ff][Ii][Ll][Ee]|[Ss]3|[Hh][Ff]):"
NOT_BLANK = r"\S"  # a non-empty string that is not only whitespace
# Paginated lists (GET /concepts, /models, /jobs, /variants, /models/{id}/variants, /models/{id}/universes):
# ?limit= (default, maximum) and ?cursor=; the body is a JSON list of one page, and the next page's
# cursor comes in this header (and in Link: <...>; rel="next"), absent on the last page.
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
NEXT_CURSOR_HEADER = "X-Next-Cursor"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_FIELD_ERROR: dict[str, Any] = {
    "type": "object",
    "properties": {
        "loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
        "msg": {"type": "string"},
        "type": {"type": "string"},
    },
}


class ProblemJob(BaseModel):
    """A job a conflict waits on (a 409's ``jobs`` member): follow ``url`` until it ends, then repeat."""

    concept: str = Field(description="the concept the job collects")
    job_id: str
    status: str = Field(description="the job's status when the request was refused (or gone)")
    url: str = Field(description="where to follow it: /jobs/{job_id}")


class Problem(BaseModel):
    """RFC 9457 problem details: every error the API returns."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "type": "https://engram.dev/problems/invalid-input",
                    "title": "Invalid input",
                    "status": 422,
                    "detail": "body.alpha: Input should be greater than 0",
                    "errors": [{"loc": ["body", "alpha"], "msg": "Input should be greater than 0", "type": "greater_than"}],
                }
            ]
        }
    )

    type: str = Field(description="a URI naming the kind of problem (https://engram.dev/problems/<slug>)")
    title: str = Field(description="a short summary, the same for every problem of this type")
    status: int = Field(description="the HTTP status code (4xx or 5xx)")
    detail: str = Field(description="what exactly is wrong with this request")
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="invalid input: each invalid field", json_schema_extra={"items": _FIELD_ERROR}
    )
    close_matches: dict[str, list[str]] | None = Field(
        default=None,
        description="names not found (misspelt concepts): each with the known names closest to it (may be empty)",
    )
    jobs: list[ProblemJob] | None = Field(
        default=None, description="a conflict with work in progress: the jobs to follow before repeating the request"
    )


def exactly_one_of(*groups: tuple[str, ...]) -> dict[str, Any]:
    """JSON Schema for "exactly one of these groups of fields, and no field of another group"."""
    names = [name for group in groups for name in group]
    return {
        "oneOf": [
            {"required": list(group), "not": {"anyOf": [{"required": [n]} for n in names if n not in group]}}
            for group in groups
        ]
    }


class DictReadable(BaseModel):
    """An answer that also reads as the JSON object it is: ``answer["key"]``, ``answer.get("key")``,
    ``"key" in answer``, as clients read it when the client returned it as a dict."""

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields or key in (self.model_extra or {})

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default
