"""Request and response bodies of the HTTP API (the reference: docs/API.md, generated from the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

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

__all__ = [
    "CalibrateRequest",
    "Calibration",
    "CalibrationCandidate",
    "CalibrationResult",
    "CalibrationSubmission",
    "CollectionReport",
    "ComposeRequest",
    "Concept",
    "ConceptCreate",
    "ConceptModelState",
    "ConceptSubmission",
    "ChatMessage",
    "DatasetColumns",
    "DatasetReference",
    "DatasetReferenceView",
    "DatasetRows",
    "EditOptions",
    "EvaluateRequest",
    "GenerateRequest",
    "Job",
    "JobProgress",
    "Layer",
    "Model",
    "ModelCreate",
    "Probe",
    "Problem",
    "TruncatedRecords",
    "UncountedRecords",
    "RecordIn",
    "Universe",
    "UniverseBytes",
    "UniverseCreate",
    "UniverseGroups",
    "UniverseMember",
    "UniverseStatusCounts",
    "UniverseSubmission",
    "UniverseKeyUsage",
    "UniverseUsage",
    "UnlearnRequest",
    "Variant",
    "VariantFile",
    "VariantSubmission",
    "VLLM_LORA_RANKS",
]


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


class ModelCreate(Strict):
    model_id: str = Field(pattern=MODEL_ID_PATTERN, max_length=200, examples=["demo/tiny-llama"])
    source: str = Field(
        max_length=2000,
        pattern=SOURCE_PATTERN,
        description="file:///abs/dir (inside ENGRAM_MODEL_ROOTS), s3://bucket/prefix/ or hf://org/name[@rev]",
    )

    @field_validator("model_id")
    @classmethod
    def _no_dot_segments(cls, value: str) -> str:
        # "." and ".." are not names: URL normalisation would make such a model unreachable.
        if any(part in {".", ".."} for part in value.split("/")):
            raise ValueError("model_id parts must not be '.' or '..'")
        return value


class Layer(BaseModel):
    name: str
    in_features: int
    out_features: int
    bias: bool


class Model(BaseModel):
    model_id: str
    source: str
    digest: str
    architecture: str
    num_parameters: int
    layers: list[Layer]
    layers_not_in_checkpoint: list[str] = Field(
        default_factory=list,
        description=(
            "editable layers of the architecture whose weight the checkpoint does not store under any name "
            "transformers loads (it initialises them at random on load): never edited"
        ),
    )


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


def _conversation(messages: list[ChatMessage]) -> None:
    if not any(m.role == "assistant" for m in messages):
        raise ValueError("the messages have no assistant message (the turn that is scored)")


class RecordIn(Strict):
    """``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [{"role", "content"}, …]}``."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: list[ChatMessage] | None = None


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
    ]
}

# Where a dataset reference may point (service.datasets.refs checks the rest: roots, path segments).
DATASET_URI_PATTERN = r"^(s3://[^/]+/.+|hf://datasets/[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._-]+)?/.+|file:///.+)$"


def exactly_one_of(*groups: tuple[str, ...]) -> dict[str, Any]:
    """JSON Schema for "exactly one of these groups of fields, and no field of another group"."""
    names = [name for group in groups for name in group]
    return {
        "oneOf": [
            {"required": list(group), "not": {"anyOf": [{"required": [n]} for n in names if n not in group]}}
            for group in groups
        ]
    }


class DatasetColumns(Strict):
    """Which source column holds each record field: ``text``, ``prompt`` + ``completion``, or ``messages``."""

    text: str | None = Field(default=None, min_length=1, max_length=200)
    prompt: str | None = Field(default=None, min_length=1, max_length=200)
    completion: str | None = Field(default=None, min_length=1, max_length=200)
    messages: str | None = Field(default=None, min_length=1, max_length=200)

    model_config = ConfigDict(json_schema_extra=exactly_one_of(("text",), ("prompt", "completion"), ("messages",)))

    @model_validator(mode="after")
    def _one_kind(self) -> DatasetColumns:
        given = {k for k in ("text", "prompt", "completion", "messages") if getattr(self, k) is not None}
        if given not in ({"text"}, {"prompt", "completion"}, {"messages"}):
            raise ValueError("columns map 'text', or 'prompt' and 'completion', or 'messages' (one kind of record)")
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
    format: Literal["jsonl", "parquet"] | None = Field(
        default=None, description="default: from the extension (.jsonl/.json/.ndjson, .parquet)"
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


class ConceptCreate(Strict):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["records"]}, {"required": ["dataset"]}]})

    name: str = Field(pattern=CONCEPT_NAME_PATTERN, json_schema_extra={"not": {"enum": [".", ".."]}})
    models: list[str] = Field(min_length=1, max_length=64)
    # Checked record by record by service.engine.records.Record (its messages name the record);
    # the schema states the same rule. The most records: ENGRAM_MAX_RECORDS (the OpenAPI document says).
    records: list[dict[str, Any]] | None = Field(default=None, min_length=1, json_schema_extra={"items": RECORD_SCHEMA})
    dataset: DatasetReference | None = Field(
        default=None, description="instead of records: a dataset the worker fetches (JSONL or Parquet)"
    )
    template: Literal["chat"] | None = Field(
        default=None,
        description=(
            '"chat": prompt/completion records are rendered with the model\'s chat template as a one-turn chat '
            "(user = prompt, assistant = completion). Messages records always are"
        ),
    )
    role: Literal["target", "reference"] = "target"
    description: str | None = Field(default=None, max_length=4000)
    callback_url: str | None = Field(
        default=None, max_length=2000, description="POSTed the collection job when it ends (host must be allowlisted)"
    )
    modules: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description=(
            "module-name suffixes (as on unlearn): collect only these layers' input groups; an edit that needs "
            "another layer is then a 409 naming it. Default: every editable layer"
        ),
    )

    @field_validator("name")
    @classmethod
    def _not_a_dot_segment(cls, value: str) -> str:
        # The pattern admits "." and "..", but URL normalisation makes /concepts/. and /concepts/..
        # other paths: such a concept could never be read or deleted.
        if value in {".", ".."}:
            raise ValueError("a concept name must not be '.' or '..'")
        return value

    @field_validator("records", "dataset", "template", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        # Left out is the way to say "none" (a concept posted again keeps its template).
        if value is None:
            raise ValueError("leave the field out rather than null")
        return value

    @model_validator(mode="after")
    def _records_or_dataset(self) -> ConceptCreate:
        if (self.records is None) == (self.dataset is None):
            raise ValueError("give records or a dataset reference (exactly one of them)")
        return self


class TruncatedRecords(BaseModel):
    max_length: int = Field(description="the tokens each record is read up to (ENGRAM_MAX_LENGTH when collected)")
    records: int = Field(description="records longer than max_length, cut there")
    tokens: int = Field(description="the tokens cut from them (counted or not)")
    first: list[int] = Field(description="the first of them (up to 10), by record index")


class UncountedRecords(BaseModel):
    records: int = Field(
        description="records without a counted token (their completion or assistant turns lie beyond max_length)"
    )
    first: list[int] = Field(description="the first of them (up to 10), by record index")


class CollectionReport(BaseModel):
    """What ``max_length`` did to a concept's records on one model, as its collection stated it.

    A record index ``i`` is ``records[i]`` of an inline body, the upload's ``i``-th record (0-based,
    blank lines not counted), or row ``rows.start + i`` of a dataset reference.
    """

    records: int = Field(description="records read")
    truncated: TruncatedRecords
    uncounted: UncountedRecords = Field(description="records that add nothing to the statistics")


class ConceptModelState(BaseModel):
    status: Literal["pending", "collecting", "ready", "failed"]
    tokens: int | None = None
    job_id: str | None = None
    truncation: CollectionReport | None = Field(
        default=None,
        description=(
            "once ready: the records read, those truncated at max_length and those left without a counted token "
            "(null before then, and for statistics collected before collections stated it)"
        ),
    )


class Concept(BaseModel):
    name: str
    role: Literal["target", "reference"]
    description: str | None = None
    num_records: int | None = Field(description="null while a dataset reference is not resolved yet")
    dataset_digest: str | None = Field(description="null while a dataset reference is not resolved yet")
    dataset: DatasetReferenceView | None = Field(default=None, description="the dataset reference, when posted with one")
    template: Literal["chat"] | None = None
    models: dict[str, ConceptModelState]


class JobProgress(BaseModel):
    done: int = 0
    total: int = 0
    unit: str = "items"


class Job(BaseModel):
    job_id: str
    kind: Literal["collect", "variant", "universe", "evaluate", "generate", "calibrate", "map", "register"]
    model_id: str | None = Field(default=None, description="the model a collection, build, map or registration is for")
    concept: str | None = Field(default=None, description="the concept a collection is for")
    variant_id: str | None = Field(default=None, description="the variant built, evaluated or generated from")
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    progress: JobProgress
    error: Problem | None = None
    result: dict[str, Any] | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class ConceptSubmission(BaseModel):
    concept: Concept
    jobs: list[Job]


# The values vLLM's --max-lora-rank accepts. vLLM refuses an adapter whose r exceeds the server's
# max_lora_rank, and loads no lora_B.bias; lora_target "vllm" writes one of these ranks for every layer.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


# The largest per-module strength factor (module_strengths): beyond it an edit is no longer a
# strength adjustment but a different edit, and a typo (40 for 0.4) would pass silently.
MAX_MODULE_STRENGTH = 4.0


class EditOptions(Strict):
    # lora_rank and lora_target "vllm" shape a peft adapter only (the service refuses them with
    # another format); with lora_target "vllm", lora_rank is one of VLLM_LORA_RANKS.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"required": ["lora_rank"], "properties": {"lora_rank": {"type": "integer"}}},
            "then": {"required": ["format"], "properties": {"format": {"const": "peft"}}},
            "allOf": [
                {
                    "if": {"required": ["lora_target"], "properties": {"lora_target": {"const": "vllm"}}},
                    "then": {
                        "required": ["format"],
                        "properties": {
                            "format": {"const": "peft"},
                            "lora_rank": {"anyOf": [{"enum": list(VLLM_LORA_RANKS)}, {"type": "null"}]},
                        },
                    },
                }
            ],
        }
    )

    scaling: Literal["uniform", "weight_norm"] = "uniform"
    modules: list[str] | None = Field(default=None, min_length=1, description="module-name suffixes")
    layers: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1, description="block indices")
    module_strengths: (
        dict[
            Annotated[str, Field(min_length=1, max_length=200)],
            Annotated[float, Field(gt=0.0, le=MAX_MODULE_STRENGTH, allow_inf_nan=False)],
        ]
        | None
    ) = Field(
        default=None,
        max_length=64,
        description=(
            "per module type, a factor on the edit strength: a layer whose name ends with a listed suffix "
            "(q_proj, mlp.gate_proj…; the longest matching suffix wins) is edited with α·f_l·s, others with "
            f"α·f_l (s = 1); 0 < s ≤ {MAX_MODULE_STRENGTH:g}. A suffix matching no edited layer is a 422. "
            "Absent or all 1: the same variant as without it"
        ),
    )
    rcond: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False, description="keep λ > rcond·λmax")
    reference: list[str] | None = Field(
        default=None, description="the universe is reference ∪ concepts (default: the model's current universe)"
    )
    universe: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="a universe of this model (GET /models/{id}/universes); default: the model's current universe",
    )
    format: Literal["checkpoint", "delta", "peft"] = "checkpoint"
    lora_rank: int | None = Field(
        default=None,
        ge=1,
        le=65536,
        description=(
            'format "peft": the largest LoRA rank (default: each layer\'s exact rank); with lora_target "vllm", '
            "the one rank of every layer, one of " + ", ".join(map(str, VLLM_LORA_RANKS)) + " (default: the smallest "
            "of these that holds every layer's edit whole, at most 512)"
        ),
    )
    lora_target: Literal["peft", "vllm"] = Field(
        default="peft",
        description=(
            'format "peft": what will load the adapter. "peft": PeftModel.from_pretrained, each layer at its own '
            'rank, bias edits in lora_bias. "vllm": servable by vLLM (--enable-lora --max-lora-rank r): one rank r '
            "for every layer, lora_alpha = r (scaling 1), no lora_bias, so a selected layer with a bias (Qwen2's "
            "q/k/v, GPT-2, BERT) is a 422 naming it; the variant's lora report gives each layer's kept energy"
        ),
    )
    callback_url: str | None = Field(
        default=None, max_length=2000, description="POSTed the build job when it ends (host must be allowlisted)"
    )

    @model_validator(mode="after")
    def _servable_rank(self) -> EditOptions:
        if self.lora_target == "vllm" and self.lora_rank is not None and self.lora_rank not in VLLM_LORA_RANKS:
            allowed = ", ".join(map(str, VLLM_LORA_RANKS))
            rank = self.lora_rank
            raise ValueError(f'lora_rank {rank} is not a rank vLLM serves: with lora_target "vllm", one of {allowed}')
        return self


class UnlearnRequest(EditOptions):
    concepts: list[str] = Field(min_length=1, max_length=256)
    alpha: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False)


Coefficient = Annotated[
    float,
    Field(gt=-1e6, lt=1e6, allow_inf_nan=False, json_schema_extra={"not": {"const": 0}}),
]


class ComposeRequest(EditOptions):
    terms: dict[str, Coefficient] = Field(min_length=1, max_length=256, description="concept -> coefficient")

    @field_validator("terms")
    @classmethod
    def _finite(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [k for k, c in value.items() if not (abs(c) < 1e6) or c == 0]
        if bad:
            raise ValueError(f"coefficients must be finite, non-zero and |c| < 1e6: {bad}")
        return value


class VariantFile(BaseModel):
    path: str
    size: int
    sha256: str


class Variant(BaseModel):
    variant_id: str
    model_id: str
    terms: dict[str, float]
    alpha: float | None
    scaling: str
    format: str
    lora_rank: int | None = None
    lora_target: Literal["peft", "vllm"] | None = Field(
        default=None, description='format "peft": what the adapter is written for (null: "peft")'
    )
    modules: list[str] | None = None
    layers: list[int] | None = None
    module_strengths: dict[str, float] | None = None
    rcond: float | None = None
    reference: list[str]
    universe_id: str | None = Field(default=None, description="the universe the engrams are measured against")
    status: Literal["building", "ready", "failed"]
    job_id: str | None = None
    files: list[VariantFile] = []
    unreached_layers: list[str] = Field(
        default_factory=list,
        description=(
            "once ready: selected layers no concept of the universe reached (their forward pass never ran them, "
            "e.g. a vision tower under text concepts): their edit is zero, and they are written as they were"
        ),
    )
    lora: dict[str, Any] | None = Field(
        default=None,
        description=(
            'format "peft", once ready: per layer its rank, kept rank, relative error and kept energy (the share '
            "of the edit's squared Frobenius norm the rank keeps), and totals"
        ),
    )


class VariantSubmission(BaseModel):
    variant: Variant
    job: Job | None = None


class UniverseCreate(Strict):
    concepts: list[str] | None = Field(
        default=None, min_length=1, max_length=256, description="default: every concept ready on the model"
    )
    rcond: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False, description="keep λ > rcond·λmax")
    callback_url: str | None = Field(
        default=None, max_length=2000, description="POSTed the build job when it ends (host must be allowlisted)"
    )


class UniverseMember(BaseModel):
    name: str
    dataset_digest: str


class UniverseGroups(BaseModel):
    done: int
    total: int | None = Field(default=None, description="known once the build has planned its input groups")


class UniverseBytes(BaseModel):
    groups: int = Field(description="the input groups' pseudo-inverse factors (float64)")
    engrams: int = Field(description="every member's engrams")
    total: int


class Universe(BaseModel):
    universe_id: str
    model_id: str
    members: list[UniverseMember]
    rcond: float | None = None
    current: bool = Field(description="requests without universe or reference use this universe")
    status: Literal["building", "ready", "failed", "evicted"] = Field(
        description="evicted: the retention rule deleted its factors and engrams; requesting it again rebuilds it"
    )
    groups: UniverseGroups = Field(description="input groups whose pseudo-inverse is stored")
    bytes: int | None = Field(default=None, description="stored factors and engrams, once ready (0 once evicted)")
    bytes_detail: UniverseBytes | None = Field(default=None, description="once ready: bytes of the factors and engrams")
    projected_bytes: int | None = Field(
        default=None, description="what the build was projected to store when requested (checked against the budget)"
    )
    build_seconds: dict[str, float] | None = Field(
        default=None, description="once ready: decomposition, engrams and total seconds of the build"
    )
    job_id: str | None = None
    created_at: datetime | None = None
    last_used: datetime | None = Field(
        default=None, description="requested, built, or a variant requested from it (the retention rule's clock)"
    )
    evicted_at: datetime | None = Field(default=None, description="when the retention rule deleted it (status evicted)")


class UniverseStatusCounts(BaseModel):
    ready: int
    building: int
    failed: int
    evicted: int


class UniverseKeyUsage(BaseModel):
    key: str = Field(description="an API key's identity (key- and 12 hex digits of its SHA-256; anonymous without auth)")
    bytes: int = Field(description="what the universes this key alone used within the retention age hold")
    universes: int


class UniverseUsage(BaseModel):
    """What universes hold in storage against ``ENGRAM_UNIVERSE_BYTES_BUDGET``."""

    model_id: str | None = Field(default=None, description="the model these totals are of; null: every universe")
    budget_bytes: int = Field(
        description="the budget in force (0: no limit): ENGRAM_UNIVERSE_BYTES_BUDGET, capped for file:// storage to "
        "ENGRAM_UNIVERSE_VOLUME_FRACTION of the store's volume"
    )
    configured_budget_bytes: int | None = Field(default=None, description="ENGRAM_UNIVERSE_BYTES_BUDGET as configured")
    volume_bytes: int | None = Field(
        default=None, description="file:// storage: the store's volume (used + free bytes); null for s3"
    )
    budget_note: str | None = Field(
        default=None, description="why the budget in force differs from the configured one, or what was not checked"
    )
    key_share: float | None = Field(
        default=None, description="ENGRAM_UNIVERSE_KEY_SHARE: the fraction of the budget one API key may keep alive"
    )
    key_share_bytes: int | None = Field(default=None, description="key_share × budget_bytes")
    keys: list[UniverseKeyUsage] = Field(
        default_factory=list, description="per API key: the universes only it used within the retention age"
    )
    retention_s: float = Field(description="ENGRAM_UNIVERSE_RETENTION_S: unused this long, a universe may be evicted")
    bytes: UniverseBytes = Field(description="stored now: factors and engrams of every universe (partial builds too)")
    reserved_bytes: int = Field(description="projected bytes of builds still running beyond what they stored so far")
    evictable_bytes: int = Field(description="what the retention rule may delete now (universes nobody uses)")
    universes: UniverseStatusCounts


class UniverseSubmission(BaseModel):
    universe: Universe
    job: Job | None = None


class Probe(Strict):
    """A question and the answer the model learned, scored on the answer tokens only; or a conversation
    ending with an assistant message, scored on that turn's counted tokens (chat template)."""

    model_config = ConfigDict(json_schema_extra=exactly_one_of(("prompt", "completion"), ("messages",)))

    # Optional, not nullable in the document (SkipJsonSchema): null is as good as left out.
    prompt: Annotated[str, Field(min_length=1, max_length=20000)] | SkipJsonSchema[None] = None
    completion: Annotated[str, Field(min_length=1, max_length=20000)] | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=2, max_length=256)] | SkipJsonSchema[None] = Field(
        default=None,
        description="the last assistant message is the turn scored (messages after it are not read)",
        json_schema_extra=CONVERSATION_RULES,
    )

    @model_validator(mode="after")
    def _one_kind(self) -> Probe:
        pair = self.prompt is not None or self.completion is not None
        if pair == (self.messages is not None):
            raise ValueError("a probe is prompt + completion, or messages")
        if pair and (self.prompt is None or self.completion is None):
            raise ValueError("a probe needs both prompt and completion")
        if self.messages is not None:
            _conversation(self.messages)
        return self


class EvaluateRequest(Strict):
    forget: list[Probe] = Field(default_factory=list, max_length=10000, description="what the variant should forget")
    retain: list[Probe] = Field(default_factory=list, max_length=10000, description="what it should keep")
    callback_url: str | None = Field(default=None, max_length=2000)

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["forget"], "properties": {"forget": {"minItems": 1}}},
                {"required": ["retain"], "properties": {"retain": {"minItems": 1}}},
            ]
        }
    )

    @model_validator(mode="after")
    def _some_probes(self) -> EvaluateRequest:
        if not self.forget and not self.retain:
            raise ValueError("give at least one forget or retain probe")
        return self


class GenerateRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    prompt: Annotated[str, Field(min_length=1, max_length=20000)] | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)] | SkipJsonSchema[None] = Field(
        default=None, description="rendered with the chat template and its generation prompt"
    )
    max_new_tokens: int = Field(default=32, ge=1, le=1024)
    models: list[Literal["base", "variant"]] = Field(default=["base", "variant"], min_length=1, max_length=2)
    callback_url: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


# ---------------------------------------------------------------- calibration

ModuleSetPreset = Literal["all", "qk_gate", "attention", "mlp", "data_weighted"]
ModuleSuffixes = Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(min_length=1, max_length=64)]
BlockIndices = Annotated[list[Annotated[int, Field(ge=0, le=100_000)]], Field(min_length=1, max_length=1024)]


class CalibrateRequest(Strict):
    """Search the edit space for the strongest unlearning whose retain NLL stays within a bound."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"required": ["lora_rank"], "properties": {"lora_rank": {"type": "integer"}}},
            "then": {"required": ["format"], "properties": {"format": {"const": "peft"}}},
            "allOf": [
                {
                    "if": {"required": ["lora_target"], "properties": {"lora_target": {"const": "vllm"}}},
                    "then": {
                        "required": ["format"],
                        "properties": {
                            "format": {"const": "peft"},
                            "lora_rank": {"anyOf": [{"enum": list(VLLM_LORA_RANKS)}, {"type": "null"}]},
                        },
                    },
                }
            ],
        }
    )

    concepts: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        min_length=1, max_length=256, description="the concepts to remove (each with ready statistics on the model)"
    )
    forget: list[Probe] = Field(min_length=1, max_length=10000, description="probes the variant should forget")
    retain: list[Probe] = Field(min_length=1, max_length=10000, description="probes it should keep")
    max_retain_nll_ratio: float = Field(
        default=2.0,
        gt=1.0,
        le=1e6,
        allow_inf_nan=False,
        description="the constraint: the retain probes' mean answer NLL, variant / base, at most this",
    )
    budget: int = Field(default=32, ge=1, le=500, description="the most candidates evaluated")
    alpha_min: float = Field(default=0.05, gt=0.0, le=100.0, allow_inf_nan=False, description="the weakest α tried")
    alpha_max: float = Field(default=4.0, gt=0.0, le=100.0, allow_inf_nan=False, description="the strongest α tried")
    scalings: list[Literal["uniform", "weight_norm"]] = Field(
        default=["uniform", "weight_norm"], min_length=1, max_length=2, description="per-layer strengths searched"
    )
    module_sets: list[ModuleSetPreset | ModuleSuffixes] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description=(
            "presets (all, qk_gate: the query/key projections and the MLP gate, attention, mlp, data_weighted: "
            "every layer, each module type at a strength from the data-weighted map) or lists of module-name "
            "suffixes; default: every preset that selects a layer of the model"
        ),
    )
    layer_sets: list[BlockIndices] | None = Field(
        default=None, min_length=1, max_length=16, description="block-index lists searched; default: every block"
    )
    rcond: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False, description="keep λ > rcond·λmax")
    reference: list[str] | None = Field(
        default=None, description="the universe is reference ∪ concepts (default: the model's current universe)"
    )
    universe: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description="a universe of this model")
    format: Literal["checkpoint", "delta", "peft"] = Field(
        default="checkpoint", description="the format of the recommended variant"
    )
    lora_rank: int | None = Field(default=None, ge=1, le=65536, description='format "peft": as on unlearn')
    lora_target: Literal["peft", "vllm"] = Field(default="peft", description='format "peft": as on unlearn')
    callback_url: str | None = Field(
        default=None, max_length=2000, description="POSTed the calibration job when it ends (host must be allowlisted)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> CalibrateRequest:
        if self.alpha_min >= self.alpha_max:
            raise ValueError(f"alpha_min ({self.alpha_min}) must be below alpha_max ({self.alpha_max})")
        if len(set(self.scalings)) != len(self.scalings):
            raise ValueError("a scaling is listed twice")
        if self.lora_rank is not None and self.format != "peft":
            raise ValueError('lora_rank shapes a format "peft" variant only')
        if self.lora_target == "vllm" and self.format != "peft":
            raise ValueError('lora_target "vllm" applies to format "peft" only')
        if self.lora_target == "vllm" and self.lora_rank is not None and self.lora_rank not in VLLM_LORA_RANKS:
            allowed = ", ".join(map(str, VLLM_LORA_RANKS))
            rank = self.lora_rank
            raise ValueError(f'lora_rank {rank} is not a rank vLLM serves: with lora_target "vllm", one of {allowed}')
        return self


class CalibrationSubmission(BaseModel):
    calibration_id: str = Field(description="a content hash of the request: the same request, the same answer")
    job: Job


class SplitScore(BaseModel):
    mean_nll: float | None = Field(description="mean answer NLL (nats/token); null when not finite")
    exact_match: float | None = Field(description="share of probes whose greedy answer is exact")
    n: int
    nll_ratio: float | None = Field(default=None, description="mean NLL, candidate / base (null when not finite)")


class CandidateOptions(BaseModel):
    alpha: float
    scaling: Literal["uniform", "weight_norm"]
    module_set: str = Field(description="a preset's name, or the custom suffixes joined by +")
    modules: list[str] | None = Field(description="the unlearn request's modules (null: every layer)")
    layers: list[int] | None = Field(description="the unlearn request's layers (null: every block)")
    module_strengths: dict[str, float] | None = Field(
        default=None,
        description=(
            "the unlearn request's module_strengths (data_weighted: each module type's mean data-weighted map "
            "value over the edited layers, relative to the largest; null: every type at 1)"
        ),
    )


class CalibrationCandidate(BaseModel):
    index: int = Field(description="evaluation order")
    options: CandidateOptions
    forget: SplitScore
    retain: SplitScore
    feasible: bool = Field(description="its retain NLL ratio meets the constraint")
    pareto: bool = Field(description="on the Pareto front: no candidate forgets more without more retain damage")
    stage: Literal["coarse", "fine"] = Field(description="coarse: bracketing the constraint; fine: refining it")


class CalibrationRecommendation(BaseModel):
    candidate: int
    options: CandidateOptions
    forget_nll_ratio: float | None
    retain_nll_ratio: float
    variant_id: str = Field(description="the candidate built as an unlearn variant (GET /variants/{variant_id})")
    variant_job_id: str | None = None
    format: Literal["checkpoint", "delta", "peft"]


class CalibrationResult(BaseModel):
    calibration_id: str
    model_id: str
    concepts: list[str]
    universe_id: str
    reference: list[str]
    constraint: dict[str, float]
    base: dict[str, SplitScore] = Field(description="the base model's scores on the forget and retain probes")
    candidates: list[CalibrationCandidate]
    pareto_front: list[int] = Field(description="indices of the candidates on the front, by increasing retain ratio")
    recommended: CalibrationRecommendation | None = Field(
        description="the feasible candidate that forgets most, built as a variant; null when none is feasible"
    )
    note: str | None = Field(default=None, description="why nothing is recommended")
    evaluations: int
    budget: int
    stopped: Literal["budget", "converged"]
    arms: list[str] = Field(description="module set[@blocks]/scaling searched")
    pruned_arms: list[str] = Field(description="arms dropped because they could not beat the best feasible candidate")
    unexplored_arms: list[str] = Field(description="arms the budget never reached")
    skipped_module_sets: list[str] = Field(description="presets that select no layer of this model")
    alpha_range: list[float]
    grid_equivalent: int = Field(description="candidates a full grid over the same arms at the same resolution needs")
    front_png: str = Field(description="where the drawn front is served")
    seconds: dict[str, float] = Field(default_factory=dict)


class Calibration(BaseModel):
    calibration_id: str
    model_id: str
    concepts: list[str]
    universe_id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    job_id: str | None = None
    result: CalibrationResult | None = None
