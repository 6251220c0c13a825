"""Concepts: ``POST /concepts`` and the concept with its per-model collection state."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api_schemas.common import CONCEPT_NAME_PATTERN, Strict
from api_schemas.jobs import Job
from api_schemas.provenance import CreationMetadata, MetadataFields
from api_schemas.records import RECORD_SCHEMA, DatasetReference, DatasetReferenceView


class SampleRequest(Strict):
    """A reference corpus the model draws itself: ``count`` texts sampled from its BOS token."""

    count: int = Field(ge=1, description="texts to draw (at most ENGRAM_MAX_SAMPLES and ENGRAM_MAX_RECORDS)")
    max_new_tokens: int = Field(ge=1, le=32768, description="tokens per text (less than the model's context)")
    temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="softmax temperature (no top-k, no top-p)")
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="the same seed draws the same texts on one machine")


class ConceptCreate(Strict, MetadataFields):
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["records"]}, {"required": ["dataset"]}, {"required": ["samples"]}]}
    )

    name: str = Field(pattern=CONCEPT_NAME_PATTERN, json_schema_extra={"not": {"enum": [".", ".."]}})
    models: list[str] = Field(min_length=1, max_length=64)
    # Checked record by record by service.engine.records.Record (its messages name the record);
    # the schema states the same rule. The most records: ENGRAM_MAX_RECORDS (the OpenAPI document says).
    records: list[dict[str, Any]] | None = Field(default=None, min_length=1, json_schema_extra={"items": RECORD_SCHEMA})
    dataset: DatasetReference | None = Field(
        default=None, description="instead of records: a dataset the worker fetches (JSONL or Parquet)"
    )
    samples: SampleRequest | None = Field(
        default=None,
        description=(
            "instead of records or a dataset: texts the one model in `models` draws itself (from its BOS token), "
            "stored as the concept's dataset; a general-text reference for a universe without one "
            '(role default "reference")'
        ),
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

    @field_validator("records", "dataset", "samples", "template", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        # Left out is the way to say "none" (a concept posted again keeps its template).
        if value is None:
            raise ValueError("leave the field out rather than null")
        return value

    @model_validator(mode="after")
    def _records_or_dataset(self) -> ConceptCreate:
        given = [self.records is not None, self.dataset is not None, self.samples is not None]
        if sum(given) != 1:
            raise ValueError("give records, a dataset reference or samples (exactly one of them)")
        if self.samples is not None:
            if len(set(self.models)) != 1:
                raise ValueError(
                    "samples are drawn by one model and belong to it: name one model in models, "
                    f"not {', '.join(self.models)} (post one concept per model)"
                )
            if self.template is not None:
                raise ValueError("samples are plain texts: leave template out")
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


class Concept(CreationMetadata):
    name: str
    role: Literal["target", "reference"]
    description: str | None = None
    num_records: int | None = Field(description="null while a dataset reference is not resolved yet")
    dataset_digest: str | None = Field(description="null while a dataset reference is not resolved yet")
    dataset: DatasetReferenceView | None = Field(default=None, description="the dataset reference, when posted with one")
    template: Literal["chat"] | None = None
    samples: SampleRequest | None = Field(
        default=None, description="the texts its one model draws, when posted with samples"
    )
    models: dict[str, ConceptModelState]


class ConceptSubmission(BaseModel):
    concept: Concept
    jobs: list[Job]
