"""Evaluation and generation: probes scored on a variant, text generated from it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.common import MODEL_ID_PATTERN, Strict, exactly_one_of
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
    # TOFU's extra answers (metrics: "tofu"), scored as if each were the completion (a chat probe:
    # its last assistant turn); a metric that needs one the probes lack is left out, naming it.
    paraphrased_answer: Annotated[str, Field(min_length=1, max_length=20000)] | SkipJsonSchema[None] = Field(
        default=None, description="the same answer in other words (TOFU's paraphrased answer)"
    )
    perturbed_answers: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=20000)]], Field(min_length=1, max_length=20)]
        | SkipJsonSchema[None]
    ) = Field(default=None, description="plausible wrong answers of the same form (TOFU's perturbed answers)")

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


# The TOFU suite's names, as OpenUnlearning names them (service.evaluation.tofu_metrics computes
# them). A retain or utility set ``<set>`` adds ``<set>_Q_A_ROUGE`` and ``<set>_Truth_Ratio``, and
# ``retain_Q_A_Prob`` (the retain set) or ``<set>_Q_A_Prob_normalised`` (a utility set).
MIA_ATTACKS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")
TOFU_FORGET_METRICS = (
    "exact_memorization",
    "extraction_strength",
    "forget_Q_A_Prob",
    "forget_Q_A_ROUGE",
    "forget_Q_A_PARA_Prob",
    "forget_Q_A_PERT_Prob",
    "forget_truth_ratio",
    *MIA_ATTACKS,
)
TOFU_SCORES = (
    "model_utility",
    "forget_quality",
    "forget_quality_log10",
    "privleak",
    *(f"{attack}_auc_vs_retain" for attack in MIA_ATTACKS),
    *(f"privacy_{attack}" for attack in MIA_ATTACKS),
    "exact_memorization_rescaled",
    "extraction_strength_rescaled",
    "forget_Q_A_PARA_Prob_rescaled",
    "forget_truth_ratio_rescaled",
    "model_utility_rescaled",
    "forget_fluency",
    "memorization",
    "utility",
    "privacy",
    "overall",
)
UTILITY_SET_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
UtilitySetName = Annotated[str, StringConstraints(pattern=UTILITY_SET_PATTERN)]
MetricName = Annotated[str, Field(min_length=1, max_length=64)]


def tofu_metric_names(utility_sets: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every name the TOFU suite can report, given the named utility sets (``retain`` is always one)."""
    per_set = [f"retain_{name}" for name in ("Q_A_Prob", "Q_A_ROUGE", "Truth_Ratio")]
    for name in utility_sets:
        per_set += [f"{name}_{metric}" for metric in ("Q_A_Prob_normalised", "Q_A_ROUGE", "Truth_Ratio")]
    return [*TOFU_FORGET_METRICS, *per_set, *TOFU_SCORES]


class EvaluateRequest(Strict):
    forget: list[Probe] = Field(default_factory=list, max_length=10000, description="what the variant should forget")
    retain: list[Probe] = Field(default_factory=list, max_length=10000, description="what it should keep")
    callback_url: str | None = Field(default=None, max_length=2000)
    metrics: Literal["tofu"] | Annotated[list[MetricName], Field(min_length=1, max_length=128)] | None = Field(
        default=None,
        description="also TOFU's metric suite (OpenUnlearning's names): \"tofu\" for all of it, or the names "
        "to report; null: answer NLL and exact match only",
    )
    retain_model: Annotated[str, Field(max_length=256, pattern=MODEL_ID_PATTERN)] | SkipJsonSchema[None] = Field(
        default=None,
        description="a registered model or a variant trained without the forget set (same tokenizer as the base): "
        "forget quality, privacy, memorization and Overall are scored against it",
    )
    holdout: list[Probe] = Field(
        default_factory=list, max_length=10000, description="facts no model saw (the MIA attacks' non-members)"
    )
    utility: dict[UtilitySetName, Annotated[list[Probe], Field(min_length=1, max_length=10000)]] = Field(
        default_factory=dict,
        max_length=8,
        description="named probe sets the forget set does not touch (TOFU's real authors, world facts): model utility",
    )

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
        if self.metrics is None:
            given = [name for name in ("retain_model", "holdout", "utility") if getattr(self, name)]
            if given:
                raise ValueError(f'{", ".join(given)} only serve metrics: add "metrics": "tofu" (or a list)')
            return self
        if not self.forget:
            raise ValueError("metrics need forget probes (TOFU's metrics are computed on the forget set)")
        reserved = sorted({"forget", "retain", "holdout"} & set(self.utility))
        if reserved:
            raise ValueError(f"utility set names {reserved} are taken by the request's own sets")
        if isinstance(self.metrics, list):
            known = tofu_metric_names(tuple(self.utility))
            unknown = [name for name in self.metrics if name not in known]
            if unknown:
                raise ValueError(f'unknown metrics {unknown}; known: "tofu" (all) or any of {", ".join(known)}')
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


TofuModel = Literal["base", "variant", "retain"]


class TofuReport(JobResult):
    """One model's TOFU values (raw values and scores, OpenUnlearning's names) and what was left out."""

    values: dict[str, float | None] = Field(
        description="every raw value and score computed (forget_quality_log10 is null for a p-value of 0: -inf)"
    )
    left_out: dict[str, str] = Field(description="metric name -> why it could not be computed")


class EvaluationResult(JobResult):
    """An ``evaluate`` job's result: both models on every probe, and per split their summaries."""

    variant_id: str
    summary: dict[Scored, dict[Split, ProbeSummary]] = Field(
        description="per model, per split (a split without probes is absent)"
    )
    records: list[ProbeRecord] = Field(description="one per probe, in request order (forget, then retain)")
    reused: bool = Field(default=False, description="answered from storage: the same probes were scored before")
    tofu: dict[TofuModel, TofuReport] | None = Field(
        default=None,
        description="with metrics: the TOFU suite per model (retain: with retain_model); absent without metrics",
    )
    retain_model: str | None = Field(default=None, description="the retain model scored against, when one was given")


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
