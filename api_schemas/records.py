"""Records and datasets: the chat message, the record shapes a concept accepts, dataset references."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from api_schemas.common import NOT_BLANK, Strict, exactly_one_of

# The roles a chat message may have (service.engine.records.ROLES says the same).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
Role = Literal["system", "developer", "user", "assistant", "tool", "ipython"]


class ChatMessage(Strict):
    """One turn of a conversation (OpenAI/TRL format)."""

    role: Role
    content: str = Field(max_length=100_000)


# What a conversation that is scored needs: an assistant message. (That it does not open with the
# assistant is checked where it is rendered: JSON Schema's prefixItems would exempt the first
# message from `items`.)
CONVERSATION_RULES: dict[str, Any] = {"contains": {"properties": {"role": {"const": "assistant"}}}}


def check_conversation(messages: list[ChatMessage]) -> None:
    if not any(m.role == "assistant" for m in messages):
        raise ValueError("the messages have no assistant message (the turn that is scored)")


_TEXT = {"type": "string", "pattern": NOT_BLANK}
# Content given as OpenAI's list of parts: only text parts are read (joined in order with "\n").
_TEXT_PARTS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "additionalProperties": False,
    },
    "description": "text parts, joined in order with a newline; a part of another type (image_url, …) is a 422",
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS]},
        "name": {"type": "string", "pattern": NOT_BLANK, "description": "a participant's name, given to the template"},
    },
    "additionalProperties": False,
}
# ShareGPT's speakers and the roles they are read as (service.engine.record_shapes.SHAREGPT_ROLES).
SHAREGPT_SPEAKERS = ("human", "user", "gpt", "assistant", "model", "system", "tool")
_SHAREGPT_TURN = {
    "type": "object",
    "required": ["from", "value"],
    "properties": {"from": {"enum": list(SHAREGPT_SPEAKERS)}, "value": {"anyOf": [{"type": "string"}, _TEXT_PARTS]}},
    "additionalProperties": False,
}
_TURNS = {
    "type": "array",
    "minItems": 1,
    "items": {"anyOf": [_MESSAGE, _SHAREGPT_TURN]},
    "contains": {
        "anyOf": [
            {
                "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [_TEXT, {"type": "array"}]}},
                "required": ["role"],
            },
            {
                "properties": {
                    "from": {"enum": ["gpt", "assistant", "model"]},
                    "value": {"anyOf": [_TEXT, {"type": "array"}]},
                },
                "required": ["from"],
            },
        ]
    },
}
RECORD_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {"type": "object", "required": ["text"], "properties": {"text": _TEXT}, "additionalProperties": False},
        {
            "type": "object",
            "required": ["prompt", "completion"],
            "properties": {"prompt": _TEXT, "completion": _TEXT},
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["messages"],
            "properties": {
                "messages": {
                    **_TURNS,
                    "description": (
                        "rendered with the model's chat template; only assistant turns are counted. Tool-call turns "
                        "(tool_calls, tool_call_id) are a 422"
                    ),
                }
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["conversations"],
            "properties": {
                "conversations": {
                    **_TURNS,
                    "description": "ShareGPT: human/user, gpt/assistant/model, system, tool turns; read as messages",
                }
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["instruction", "output"],
            "properties": {"instruction": _TEXT, "input": {"type": ["string", "null"]}, "output": _TEXT},
            "additionalProperties": False,
            "description": (
                "Alpaca: read as {prompt, completion}: prompt = instruction, or instruction + blank line + input "
                "when input is not empty; completion = output"
            ),
        },
        {
            "type": "object",
            "required": ["image"],
            "properties": {
                "image": {
                    "type": "string",
                    "minLength": 1,
                    "description": (
                        "for an image classifier: the base64 of a PNG, JPEG or WebP file (a data:image/...;base64, "
                        "prefix is allowed), at most ENGRAM_MAX_IMAGE_PIXELS pixels and 100:1 from longer side to shorter"
                    ),
                },
                "label": {
                    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1}],
                    "description": "a class id, or a class name in the model's id2label; statistics ignore it",
                },
            },
            "additionalProperties": False,
        },
    ]
}

# Where a dataset reference may point (service.datasets.refs checks the rest: roots, path segments).
DATASET_URI_PATTERN = r"^(s3://[^/]+/.+|hf://datasets/[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._-]+)?/.+|file:///.+)$"


def _columns_schema() -> dict[str, Any]:
    """One kind of record's columns; ``label`` only beside ``image``."""
    schema = exactly_one_of(("text",), ("prompt", "completion"), ("messages",), ("image",))
    for option in schema["oneOf"]:
        if option["required"] != ["image"]:
            option["not"]["anyOf"].append({"required": ["label"]})
    return schema


class DatasetColumns(Strict):
    """Which source column holds each record field: ``text``, ``prompt`` + ``completion``, ``messages``,
    or ``image`` (and optionally ``label``)."""

    text: str | None = Field(default=None, min_length=1, max_length=200)
    prompt: str | None = Field(default=None, min_length=1, max_length=200)
    completion: str | None = Field(default=None, min_length=1, max_length=200)
    messages: str | None = Field(default=None, min_length=1, max_length=200)
    # Absent when unset (exclude_if): a text reference's stored and shown columns, and so its
    # digest, are what they were before image columns existed.
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="images: a datasets Image struct {bytes, path}, bytes or base64",
        exclude_if=lambda v: v is None,
    )
    label: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="with image: class ids or names",
        exclude_if=lambda v: v is None,
    )

    model_config = ConfigDict(json_schema_extra=_columns_schema())

    @model_validator(mode="after")
    def _one_kind(self) -> DatasetColumns:
        given = {k for k in ("text", "prompt", "completion", "messages", "image", "label") if getattr(self, k) is not None}
        if given not in ({"text"}, {"prompt", "completion"}, {"messages"}, {"image"}, {"image", "label"}):
            raise ValueError(
                "columns map 'text', or 'prompt' and 'completion', or 'messages', or 'image' and optionally 'label' "
                "(one kind of record)"
            )
        return self


class DatasetRows(Strict):
    """A range of rows, 0-based, ``stop`` excluded (JSONL: non-blank lines; Parquet: rows)."""

    start: int = Field(default=0, ge=0)
    stop: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> DatasetRows:
        if self.stop is not None and self.stop <= self.start:
            raise ValueError("rows.stop must be greater than rows.start")
        return self


class DatasetReference(Strict):
    """A dataset the worker fetches and streams, instead of inline records."""

    uri: str = Field(
        max_length=2000,
        pattern=DATASET_URI_PATTERN,
        description=(
            "s3://bucket/key, hf://datasets/org/name[@revision]/path, or file:///abs/path inside "
            "ENGRAM_DATASET_ROOTS or ENGRAM_MODEL_ROOTS"
        ),
        examples=["s3://datasets/tofu/forget.parquet"],
    )
    format: Literal["jsonl", "parquet", "imagefolder"] | None = Field(
        default=None,
        description=(
            "default: from the extension (.jsonl/.json/.ndjson, .parquet); a file:// folder is an imagefolder "
            "(one subfolder of PNG, JPEG or WebP files per class, the folder's name its label)"
        ),
    )
    columns: DatasetColumns | None = Field(
        default=None, description="default: JSONL lines are records as they are; Parquet columns named like the fields"
    )
    rows: DatasetRows | None = None


class DatasetReferenceView(DatasetReference):
    """A concept's dataset reference and what it resolved to."""

    model_config = ConfigDict(extra="ignore")

    uri: str
    digest: str | None = Field(default=None, description="the resolved dataset's digest (null until resolved)")
    status: Literal["pending", "resolved", "failed"] = "pending"
    error: str | None = Field(default=None, description="why it did not resolve (the collection job's problem)")
    fingerprint: dict[str, str | int] | None = Field(
        default=None,
        description=(
            "what the referenced content was when it was posted, which every read is pinned to (a change is a "
            "failed job, and posting the reference again makes a new collection): file:// size, mtime_ns and "
            "inode; s3:// etag and size (and version_id in a versioned bucket); hf:// the commit. null: it "
            "could not be looked at when posted"
        ),
    )
