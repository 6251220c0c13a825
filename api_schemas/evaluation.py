"""Evaluation and generation: probes scored on a variant, text generated from it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictInt, StrictStr, StringConstraints, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.attacks import Attack, check_attacks
from api_schemas.common import MODEL_ID_PATTERN, Strict, exactly_one_of
from api_schemas.evaluation_provenance import EvaluationMetadata
from api_schemas.jobs import JobResult, TrackingRun
from api_schemas.provenance import MetadataFields
from api_schemas.records import CONVERSATION_RULES, ChatMessage, check_conversation

IMAGE_PROBE_FIELDS = ("image", "label")
ProbeKind = Literal["text", "image"]


class Probe(Strict):
    """A question and the answer the model learned, scored on the answer tokens only; or a conversation
    ending with an assistant message, scored on that turn's counted tokens (chat template); or, for an
    image classifier, a labelled image (``image`` + ``label``), scored on its top-1 class and the NLL of
    its label.

    Exactly one kind per probe: ``prompt`` + ``completion``, ``messages``, or ``image`` + ``label``
    (:attr:`kind` tells which). A request's probes are all of one kind, the kind of the variant's model.
    """

    model_config = ConfigDict(json_schema_extra=exactly_one_of(("prompt", "completion"), ("messages",), IMAGE_PROBE_FIELDS))

    # Optional, not nullable in the document (SkipJsonSchema): null is as good as left out.
    prompt: Annotated[str, Field(min_length=1, max_length=20000)] | SkipJsonSchema[None] = None
    completion: Annotated[str, Field(min_length=1, max_length=20000)] | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=2, max_length=256)] | SkipJsonSchema[None] = Field(
        default=None,
        description="the last assistant message is the turn scored (messages after it are not read)",
        json_schema_extra=CONVERSATION_RULES,
    )
    image: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = Field(
        default=None,
        description="for an image classifier: the base64 of a PNG, JPEG or WebP file (a data:image/...;base64, prefix "
        "is allowed), at most ENGRAM_MAX_IMAGE_PIXELS pixels and 100:1 from longer side to shorter; decoded and "
        "processed as concept records are",
    )
    label: StrictInt | Annotated[StrictStr, Field(max_length=256)] | SkipJsonSchema[None] = Field(
        default=None,
        description="with image (required there): the image's class, an id in [0, num_labels) or a name in the "
        "model's id2label",
        json_schema_extra={"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1}]},
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

    @property
    def kind(self) -> ProbeKind:
        """``"image"`` for a labelled image, ``"text"`` for prompt + completion or messages."""
        return "image" if self.image is not None else "text"

    @model_validator(mode="after")
    def _one_kind(self) -> Probe:
        pair = self.prompt is not None or self.completion is not None
        pictured = self.image is not None or self.label is not None
        if sum((pair, self.messages is not None, pictured)) != 1:
            raise ValueError("a probe is prompt + completion, or messages, or image + label")
        if pair and (self.prompt is None or self.completion is None):
            raise ValueError("a probe needs both prompt and completion")
        if pictured:
            if self.image is None or self.label is None:
                raise ValueError("an image probe needs both image and label (its class id or name)")
            if isinstance(self.label, int) and self.label < 0:
                raise ValueError(f"label {self.label} is negative (class ids count from 0)")
            if isinstance(self.label, str) and not self.label.strip():
                raise ValueError("label is an empty name")
            extra = [n for n in ("paraphrased_answer", "perturbed_answers") if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"an image probe has no answers to paraphrase or perturb: drop {', '.join(extra)}")
        if self.messages is not None:
            check_conversation(self.messages)
        return self


def _a(kind: ProbeKind) -> str:
    return f"an {kind}" if kind == "image" else f"a {kind}"


def probes_kind(probes: list[Probe]) -> ProbeKind | None:
    """The one kind of ``probes`` (None for no probes).

    Raises:
        ValueError: text and image probes together, naming the first probe of the other kind.
    """
    if not probes:
        return None
    first = probes[0].kind
    for index, probe in enumerate(probes):
        if probe.kind != first:
            raise ValueError(f"probe {index} is {_a(probe.kind)} probe, probe 0 {_a(first)} probe: one kind per request")
    return first


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


CLASSIFIER_SETS = ("forget", "retain", "test")


class EvaluateRequest(Strict, MetadataFields):
    forget: list[Probe] = Field(default_factory=list, max_length=10000, description="what the variant should forget")
    retain: list[Probe] = Field(default_factory=list, max_length=10000, description="what it should keep")
    test: list[Probe] = Field(
        default_factory=list,
        max_length=10000,
        description="image probes only: held-out images of every class (ToW's third set, the test accuracy)",
    )
    callback_url: str | None = Field(default=None, max_length=2000)
    metrics: Literal["tofu"] | Annotated[list[MetricName], Field(min_length=1, max_length=128)] | None = Field(
        default=None,
        description="also TOFU's metric suite (OpenUnlearning's names): \"tofu\" for all of it, or the names "
        "to report; null: answer NLL and exact match only. Text probes only",
    )
    retain_model: Annotated[str, Field(max_length=256, pattern=MODEL_ID_PATTERN)] | SkipJsonSchema[None] = Field(
        default=None,
        description="a registered model or a variant trained without the forget set. Text probes (with metrics; "
        "same tokenizer as the base): forget quality, privacy, memorization and Overall are scored against it. "
        "Image probes (an image classifier with the base's classes): the retrained model of ToW and CKA",
    )
    holdout: list[Probe] = Field(
        default_factory=list, max_length=10000, description="facts no model saw (the MIA attacks' non-members)"
    )
    utility: dict[UtilitySetName, Annotated[list[Probe], Field(min_length=1, max_length=10000)]] = Field(
        default_factory=dict,
        max_length=8,
        description="named probe sets the forget set does not touch (TOFU's real authors, world facts): model utility",
    )
    attacks: Annotated[list[Attack], Field(max_length=8)] = Field(
        default_factory=list,
        description="text probes: attacks on the forgetting (api_schemas.attacks), each applied to the variant, the "
        "base and the retain_model, every metric asked for reported per attack (result.attacks, by attack name)",
    )

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["forget"], "properties": {"forget": {"minItems": 1}}},
                {"required": ["retain"], "properties": {"retain": {"minItems": 1}}},
            ]
        }
    )

    @property
    def kind(self) -> ProbeKind:
        """The request's probe kind (every probe is of it: checked)."""
        return "image" if any(p.kind == "image" for p in (*self.forget, *self.retain, *self.test)) else "text"

    @model_validator(mode="after")
    def _some_probes(self) -> EvaluateRequest:
        if not self.forget and not self.retain:
            raise ValueError("give at least one forget or retain probe")
        self._one_probe_kind()
        if self.kind == "image":
            if self.attacks:
                raise ValueError("attacks (quantize, relearn, rephrase) are for language models' text probes")
            given = [name for name in ("metrics", "holdout", "utility") if getattr(self, name)]
            if given:
                raise ValueError(
                    f"{', '.join(given)} serve TOFU's metrics on text probes; image probes are scored by accuracy, "
                    "label NLL and (with retain_model) ToW and CKA"
                )
            return self
        if self.test:
            raise ValueError("test probes are for image classifiers (image + label probes)")
        check_attacks(self.attacks, self.forget)
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

    def _one_probe_kind(self) -> None:
        """Refuse text and image probes in one request, naming the first probe of the other kind."""
        named = [(f"{s}[{i}]", p) for s in CLASSIFIER_SETS for i, p in enumerate(getattr(self, s))]
        named += [(f"holdout[{i}]", p) for i, p in enumerate(self.holdout)]
        named += [(f"utility.{n}[{i}]", p) for n, items in self.utility.items() for i, p in enumerate(items)]
        first_where, first = named[0]
        for where, probe in named:
            if probe.kind != first.kind:
                raise ValueError(
                    f"{where} is {_a(probe.kind)} probe but {first_where} is {_a(first.kind)} probe: "
                    "a request's probes are all of one kind"
                )


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

Split = Literal["forget", "retain", "test"]
Scored = Literal["base", "variant"]


class ProbeSummary(JobResult):
    mean_nll: float = Field(description="mean answer NLL (nats/token); image probes: mean NLL of the label (nats)")
    exact_match: float = Field(description="the share of probes whose greedy answer is exact; image probes: top-1 accuracy")
    n: int = Field(description="probes scored")


class ProbeScore(JobResult):
    nll: float = Field(description="the answer's NLL (nats/token); an image probe: −log p(label) (nats)")
    exact_match: bool = Field(description="the greedy answer is exact; an image probe: its top-1 class is its label")


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


ClassifierSet = Literal["forget", "retain", "test"]
ClassifierModel = Literal["base", "variant", "retrained"]


class ClassifierSetReport(JobResult):
    """One classifier on one probe set."""

    n: int = Field(description="probes in the set")
    accuracy: float = Field(description="top-1 accuracy: the share of probes whose largest logit is their label")
    label_nll: float = Field(description="mean over probes of −log softmax(logits)[label] (nats)")
    confusion: dict[str, list[float]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="per forgotten class (a label of the forget probes, by id) with probes in this set: the share "
        "of its probes predicted as each class (num_labels values summing to 1); absent when the set has none",
    )


class ClassifierModelReport(JobResult):
    """One classifier's results on each probe set given, and the geometry of its penultimate features."""

    sets: dict[ClassifierSet, ClassifierSetReport] = Field(description="per probe set given (an empty set is absent)")
    da: float | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="dimensional alignment (Seo et al. 2025) of the penultimate features: the share of the forget "
        "features' energy inside the retain features' principal subspace (99% of its energy); with forget and "
        "retain probes. A retrained model's is the target",
    )
    nmi: float | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="NMI (Seo et al. 2025) between a k-means clustering of the forget and retain probes' penultimate "
        "features (k = their distinct labels) and their labels; with forget and retain probes",
    )


class ClassifierScores(JobResult):
    """The variant compared with the base and the retrained model."""

    tow: float | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="ToW (Zhao et al. 2024) of the variant against the retrained model: the product over the "
        "forget, retain and test sets of (1 − |accuracy(variant) − accuracy(retrained)|); in [0, 1], 1 best. "
        "Needs retain_model and all three sets",
    )
    cka_to_base: dict[ClassifierSet, float] = Field(
        description="per probe set: linear CKA (Kornblith et al. 2019) of the variant's penultimate features to the "
        "base's on the same probes"
    )
    cka_to_retrained: dict[ClassifierSet, float] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="per probe set: linear CKA of the variant's penultimate features to the retrained model's; "
        "with retain_model",
    )
    left_out: dict[str, str] = Field(
        default_factory=dict,
        description="a score (or score.set) not computed -> why (a set without probes, a constant representation)",
    )


class ClassifierEvaluation(JobResult):
    """An evaluation of an image classifier: per model and probe set, accuracy, label NLL and the confusion of
    the forgotten classes; the features' DA and NMI; and the variant's ToW and CKA."""

    forgotten_classes: list[int] = Field(description="the class ids the forget probes are labelled with")
    models: dict[ClassifierModel, ClassifierModelReport] = Field(
        description="base, variant and (with retain_model) retrained: the retain_model given"
    )
    scores: ClassifierScores


class EvaluationResult(JobResult, EvaluationMetadata):
    """An ``evaluate`` job's result: both models on every probe, and per split their summaries; who asked,
    when and why, and each probe set's digest (:class:`EvaluationMetadata`)."""

    variant_id: str
    summary: dict[Scored, dict[Split, ProbeSummary]] = Field(
        description="per model, per split (a split without probes is absent)"
    )
    records: list[ProbeRecord] = Field(description="one per probe, in request order (forget, retain, then test)")
    reused: bool = Field(default=False, description="answered from storage: the same probes were scored before")
    tofu: dict[TofuModel, TofuReport] | None = Field(
        default=None,
        description="with metrics: the TOFU suite per model (retain: with retain_model); absent without metrics",
    )
    retain_model: str | None = Field(default=None, description="the retain model scored against, when one was given")
    classifier: ClassifierEvaluation | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="image probes: the classifier's metrics (absent for text probes)",
    )
    truncated_probes: dict[str, int] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="probe set (forget, retain, holdout, a utility set) -> probes whose prompt was cut on the left "
        "to fit what the model reads (the smaller of its context and ENGRAM_MAX_LENGTH tokens: the last prompt "
        "tokens kept, the answers whole; an answer longer than that fails the job naming it); absent when none was",
    )
    attacks: dict[str, AttackReport] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="attack name (quantize:Q4_1, relearn, rephrase:no_template) -> its scores; with attacks",
    )
    tracking: TrackingRun | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="with ENGRAM_MLFLOW_TRACKING_URI: the evaluation's MLflow run, or why it could not be logged "
        "(the evaluation is kept either way); absent when answered from storage",
    )


class AttackReport(JobResult):
    """One attack's scores: each model attacked, on the probes the attack scores."""

    attack: dict[str, Any] = Field(description="the attack as requested, with its defaults")
    summary: dict[TofuModel, dict[Split, ProbeSummary]] = Field(
        description="per model attacked (base, variant, retain with retain_model) and split: answer NLL and exact match"
    )
    unattacked: dict[TofuModel, dict[Split, ProbeSummary]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="relearn: the models before the attack on the same probes (the rest of the forget set)",
    )
    recovered_fraction: float | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="relearn: (attacked variant − variant) / (base − variant) on forget exact match; absent when the "
        "base answers no more than the variant (left_out says so)",
    )
    tofu: dict[TofuModel, TofuReport] | None = Field(
        default=None, exclude_if=lambda v: v is None, description="with metrics: TOFU's suite on the attacked models"
    )
    quantized: dict[TofuModel, dict[str, int]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="quantize: per model, tensors rounded per type applied (a variant saved untied has its own head)",
    )
    kept: dict[TofuModel, dict[str, str]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="quantize: per model, 2-D tensors left unquantized -> why (norms and biases are never quantized)",
    )
    passed: bool | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="with the attack's thresholds: the variant meets every one after the attack (a value that could "
        "not be measured fails)",
    )
    margins: dict[str, float] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="with thresholds: per bound (min_<metric> / max_<metric>) how far inside it the attacked variant is "
        "(negative: outside it)",
    )
    left_out: dict[str, str] = Field(default_factory=dict, description="a value not computed -> why")
    seconds: float = Field(description="what the attack took (applying it and scoring every model)")


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
    prompt_truncated: bool | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="true when the prompt (or the rendered messages) was cut on the left to fit what the model "
        "reads (the smaller of its context less max_new_tokens and ENGRAM_MAX_LENGTH tokens); absent otherwise",
    )
