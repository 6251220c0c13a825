"""Evaluation and generation: probes scored on a variant, text generated from it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.common import Strict, exactly_one_of
from api_schemas.jobs import JobResult
from api_schemas.records import CONVERSATION_RULES, ChatMessage, check_conversation


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
            check_conversation(self.messages)
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


# ---------------------------------------------------------------- results (the jobs' ``result``)

Split = Literal["forget", "retain"]
Scored = Literal["base", "variant"]


class ProbeSummary(JobResult):
    mean_nll: float = Field(description="mean answer NLL (nats/token)")
    exact_match: float = Field(description="the share of probes whose greedy answer is exact")
    n: int = Field(description="probes scored")


class ProbeScore(JobResult):
    nll: float = Field(description="the answer's NLL (nats/token)")
    exact_match: bool = Field(description="the greedy answer is exact")


class ProbeRecord(JobResult):
    split: Split
    index: int = Field(description="the probe's position in its split of the request")
    base: ProbeScore
    variant: ProbeScore


class EvaluationResult(JobResult):
    """An ``evaluate`` job's result: both models on every probe, and per split their summaries."""

    variant_id: str
    summary: dict[Scored, dict[Split, ProbeSummary]] = Field(
        description="per model, per split (a split without probes is absent)"
    )
    records: list[ProbeRecord] = Field(description="one per probe, in request order (forget, then retain)")
    reused: bool = Field(default=False, description="answered from storage: the same probes were scored before")


class GeneratedText(JobResult):
    text: str
    token_ids: list[int]


class GenerationResult(JobResult):
    """A ``generate`` job's result: the greedy continuation by each model asked for."""

    variant_id: str
    prompt: str | None = Field(description="the prompt sent (null: messages were sent)")
    # As sent ({role, content} objects), not ChatMessage: a caller compares them with what it sent.
    messages: list[dict[str, str]] | None = Field(default=None, description="the messages sent, when they were")
    outputs: dict[Scored, GeneratedText]
