"""Calibration: the search over strength, scaling, modules and layers, and its result."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.calibration_attacks import (
    ATTACK_CONSTRAINTS_FIELD,
    ATTACK_GATE_FIELD,
    ATTACKED_FIELD,
    AttackConstraint,
    AttackGate,
    check_attack_constraints,
)
from api_schemas.calibration_default import (
    MAX_PERPLEXITY_RATIO_FIELD,
    MIN_RETAIN_EXACT_MATCH_RATIO_FIELD,
    PERPLEXITY_ON_FIELD,
    RETAIN_PROBES_IN_REFERENCE_FIELD,
    TRUNCATED_PROBES_FIELD,
    WARNINGS_FIELD,
    check_default_objective,
    check_no_default_bounds,
)
from api_schemas.common import MODEL_ID_PATTERN, Strict
from api_schemas.edit_options import ADAPTER_OPTION_RULES, VLLM_LORA_RANKS
from api_schemas.evaluation import CLASSIFIER_SETS, Probe, ProbeKind, UtilitySetName, tofu_metric_names
from api_schemas.jobs import Job, JobResult

ModuleSetPreset = Literal["all", "qk_gate", "attention", "mlp", "data_weighted"]
ModuleSuffixes = Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(min_length=1, max_length=64)]
BlockIndices = Annotated[list[Annotated[int, Field(ge=0, le=100_000)]], Field(min_length=1, max_length=1024)]


# A calibration's own metrics (per candidate, on the forget and retain probes), beside TOFU's names.
CALIBRATION_METRICS = (
    "forget_nll_ratio",
    "retain_nll_ratio",
    "forget_mean_nll",
    "retain_mean_nll",
    "forget_exact_match",
    "retain_exact_match",
    "perplexity_ratio",
)
MetricName = Annotated[str, Field(min_length=1, max_length=64)]
Bound = Annotated[float, Field(allow_inf_nan=False, ge=-1e12, le=1e12)]
Ratio = Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=1e6)]


# An image classifier's metrics (per candidate, on the forget, retain and test probes), named as
# evaluate's ``classifier`` section reports them: ``<set>_accuracy`` is its ``models.variant.sets.<set>.accuracy``,
# ``<set>_label_nll`` its ``label_nll``, ``tow`` its ``scores.tow``, ``cka_to_base_<set>`` its
# ``scores.cka_to_base.<set>`` (and ``cka_to_retrained_<set>``); ``<set>_label_nll_ratio`` is the
# label NLL, candidate / base.
CLASSIFIER_METRICS = (
    *(f"{s}_{m}" for s in CLASSIFIER_SETS for m in ("accuracy", "label_nll", "label_nll_ratio")),
    "tow",
    *(f"cka_to_{m}_{s}" for m in ("base", "retrained") for s in CLASSIFIER_SETS),
)
# A classifier calibration with no objective: the lowest forget accuracy with the retain accuracy at
# least this share of the base's, or, given a retrained model, the highest ToW.
DEFAULT_RETAIN_ACCURACY_RATIO = 0.9


def calibration_metric_names(utility_sets: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every metric an objective or a constraint may name on text probes: the calibration's own, then TOFU's."""
    return [*CALIBRATION_METRICS, *tofu_metric_names(utility_sets)]


def _a(kind: ProbeKind) -> str:
    return f"an {kind}" if kind == "image" else f"a {kind}"


class Objective(Strict):
    """The score the calibration optimises: exactly one of ``maximize`` and ``minimize``."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["maximize"]}, {"required": ["minimize"]}]})

    maximize: MetricName | SkipJsonSchema[None] = Field(default=None, description="a metric to maximise (overall)")
    minimize: MetricName | SkipJsonSchema[None] = Field(default=None, description="a metric to minimise")

    @model_validator(mode="after")
    def _one(self) -> Objective:
        if (self.maximize is None) == (self.minimize is None):
            raise ValueError("an objective is maximize or minimize, one metric")
        return self

    @property
    def metric(self) -> str:
        return self.maximize or self.minimize or ""

    @property
    def sense(self) -> Literal["maximize", "minimize"]:
        return "maximize" if self.maximize is not None else "minimize"


class MetricConstraint(Strict):
    """Bounds on one metric of the candidate: absolute (``min``, ``max``) or relative to the base
    model's value on the same probes (``min_ratio_to_base``: value ≥ ratio × base's)."""

    metric: MetricName
    min: Bound | SkipJsonSchema[None] = Field(default=None, description="the value at least this")
    max: Bound | SkipJsonSchema[None] = Field(default=None, description="the value at most this")
    min_ratio_to_base: Ratio | SkipJsonSchema[None] = Field(
        default=None, description="the value at least this times the base model's (model_utility ≥ 0.9 × base's)"
    )
    max_ratio_to_base: Ratio | SkipJsonSchema[None] = Field(
        default=None, description="the value at most this times the base model's (retain_nll_ratio-like damage)"
    )

    @model_validator(mode="after")
    def _some_bound(self) -> MetricConstraint:
        bounds = (self.min, self.max, self.min_ratio_to_base, self.max_ratio_to_base)
        if all(b is None for b in bounds):
            bounds_named = "min, max, min_ratio_to_base or max_ratio_to_base"
            raise ValueError(f"the constraint on {self.metric} has no bound: {bounds_named}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"the constraint on {self.metric} has min {self.min} above max {self.max}")
        return self


class CalibrateRequest(Strict):
    """Search the edit space for the strongest unlearning whose retain NLL stays within a bound; or,
    with ``objective``, for the best value of a named score (TOFU's ``overall`` …) within ``constraints``.

    With labelled image probes (an image classifier), the search is on the classifier's metrics
    (``forget_accuracy``, ``retain_accuracy``, ``tow`` …); without an objective it minimises
    ``forget_accuracy`` with ``retain_accuracy`` ≥ 0.9 × the base's, or, given ``retain_model``,
    maximises ``tow``."""

    model_config = ConfigDict(json_schema_extra=ADAPTER_OPTION_RULES)

    concepts: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        min_length=1, max_length=256, description="the concepts to remove (each with ready statistics on the model)"
    )
    forget: list[Probe] = Field(min_length=1, max_length=10000, description="probes the variant should forget")
    retain: list[Probe] = Field(min_length=1, max_length=10000, description="probes it should keep")
    test: list[Probe] = Field(
        default_factory=list,
        max_length=10000,
        description="image probes only: held-out images of every class (test_accuracy, and ToW's third set)",
    )
    max_retain_nll_ratio: float = Field(
        default=2.0,
        gt=1.0,
        le=1e6,
        allow_inf_nan=False,
        description="set without an objective: the older search, the strongest forget NLL ratio with the retain "
        "probes' mean answer NLL, variant / base, at most this (left out: the exact-match default objective)",
    )
    min_retain_exact_match_ratio: float = MIN_RETAIN_EXACT_MATCH_RATIO_FIELD
    max_perplexity_ratio: float = MAX_PERPLEXITY_RATIO_FIELD
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
    objective: Objective | SkipJsonSchema[None] = Field(
        default=None,
        description="a named score to optimise (a TOFU name, as evaluate reports it, or forget_nll_ratio ...; for image "
        "probes forget_accuracy, tow ...) under constraints; absent: the lowest forget_exact_match with "
        "retain_exact_match >= min_retain_exact_match_ratio x the base's and perplexity_ratio <= max_perplexity_ratio "
        "(NLL ratios break ties; with max_retain_nll_ratio set, the strongest forget NLL ratio within it) (image "
        "probes: the lowest forget_accuracy with retain_accuracy >= 0.9 x the base's, or with retain_model the "
        "highest tow)",
    )
    constraints: list[MetricConstraint] = Field(
        default_factory=list,
        max_length=16,
        description="with objective (or image probes): bounds every recommended candidate meets",
    )
    retain_model: Annotated[str, Field(max_length=256, pattern=MODEL_ID_PATTERN)] | SkipJsonSchema[None] = Field(
        default=None,
        description="with objective (or image probes): a registered model or variant trained without the forget set "
        "(forget_quality, privacy, memorization, overall need it; for an image classifier tow and cka_to_retrained_*)",
    )
    holdout: list[Probe] = Field(
        default_factory=list, max_length=10000, description="with objective: facts no model saw (the raw MIA AUCs)"
    )
    utility: dict[UtilitySetName, Annotated[list[Probe], Field(min_length=1, max_length=10000)]] = Field(
        default_factory=dict,
        max_length=8,
        description="with objective: named probe sets for model utility, as evaluate; without one, only "
        "general: plain general text (prompt: its first words, completion: the rest), the perplexity bound's set",
    )
    # Bounds checked by _fraction: as Field(gt=, lt=) on this union they were compared with a null (a
    # TypeError: a 500), and as bounds of the float branch a 422 would name the branch, not the field.
    held_out_fraction: float | SkipJsonSchema[None] = Field(
        default=None,
        json_schema_extra={"exclusiveMinimum": 0.0, "exclusiveMaximum": 1.0},
        description="with objective (or image probes, or the default objective): this share of the forget, retain, "
        "test and utility probes is kept out of the search, to check the recommended variant against the constraints "
        "on probes it was not chosen on (the default objective: 0.2 when left out)",
    )

    attack_constraints: list[AttackConstraint] = ATTACK_CONSTRAINTS_FIELD

    @field_validator("held_out_fraction")
    @classmethod
    def _fraction(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:  # NaN fails both comparisons
            raise ValueError(f"held_out_fraction must be between 0 and 1 (both excluded), not {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CalibrateRequest:
        if self.kind == "image":
            self._check_classifier_goal()
        else:
            self._check_goal()
        check_attack_constraints(self)
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

    @property
    def kind(self) -> ProbeKind:
        """The request's probe kind: ``"image"`` (labelled images, an image classifier) or ``"text"``.

        Raises:
            ValueError: text and image probes together, naming the first probe of the other kind.
        """
        sets = {"forget": self.forget, "retain": self.retain, "test": self.test, "holdout": self.holdout}
        named = [(f"{name}[{i}]", p) for name, items in sets.items() for i, p in enumerate(items)]
        named += [(f"utility.{n}[{i}]", p) for n, items in self.utility.items() for i, p in enumerate(items)]
        first_where, first = named[0]  # forget has at least one probe
        for where, probe in named:
            if probe.kind != first.kind:
                raise ValueError(
                    f"{where} is {_a(probe.kind)} probe but {first_where} is {_a(first.kind)} probe: "
                    "a calibration's probes are all of one kind (labelled images for an image classifier, "
                    "prompt + completion or messages for a language model)"
                )
        return first.kind

    def _check_classifier_goal(self) -> None:
        """Image probes: the classifier's metrics, the options that serve them, and no text-only option."""
        given = [name for name in ("holdout", "utility") if getattr(self, name)]
        if given:
            raise ValueError(
                f"{', '.join(given)} serve TOFU's metrics on text probes; an image classifier is calibrated on "
                "accuracy, label NLL, ToW and CKA (forget, retain and test image probes)"
            )
        if "max_retain_nll_ratio" in self.model_fields_set:
            raise ValueError(
                "max_retain_nll_ratio bounds the answer NLL of text probes; for image probes bound the classifier's "
                'metrics: constraints [{"metric": "retain_accuracy", "min_ratio_to_base": 0.9}]'
            )
        if self.held_out_fraction is not None and (len(self.forget) < 2 or len(self.retain) < 2):
            raise ValueError("held_out_fraction needs two forget and two retain probes (one searched, one held out)")
        named = [*([self.objective.metric] if self.objective is not None else []), *(c.metric for c in self.constraints)]
        text = set(calibration_metric_names()) - set(CLASSIFIER_METRICS)
        wrong = list(dict.fromkeys(name for name in named if name in text))
        if wrong:
            raise ValueError(
                f"{', '.join(wrong)}: a metric of text probes (answer NLL, TOFU), but these are image probes of an "
                f"image classifier; its metrics: {', '.join(CLASSIFIER_METRICS)}"
            )
        unknown = list(dict.fromkeys(name for name in named if name not in CLASSIFIER_METRICS))
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; an image classifier's: {', '.join(CLASSIFIER_METRICS)}")

    def _check_goal(self) -> None:
        """The objective's options are given with an objective only, and name known metrics."""
        if self.test:
            raise ValueError("test probes are for image classifiers (image + label probes); text probes: forget, retain")
        if self.objective is None:
            options = ("constraints", "retain_model", "holdout")
            given = [name for name in options if getattr(self, name)]
            if given:
                raise ValueError(f"{', '.join(given)} only serve an objective: add an objective (maximize or minimize)")
            check_default_objective(self)
            return
        check_no_default_bounds(self)
        if self.held_out_fraction is not None and (len(self.forget) < 2 or len(self.retain) < 2):
            raise ValueError("held_out_fraction needs two forget and two retain probes (one searched, one held out)")
        reserved = sorted({"forget", "retain", "holdout"} & set(self.utility))
        if reserved:
            raise ValueError(f"utility set names {reserved} are taken by the request's own sets")
        known = calibration_metric_names(tuple(self.utility))
        named = [self.objective.metric, *(c.metric for c in self.constraints)]
        pictured = list(dict.fromkeys(name for name in named if name in CLASSIFIER_METRICS and name not in known))
        if pictured:
            raise ValueError(
                f"{', '.join(pictured)}: a metric of an image classifier (labelled image probes), but these are text "
                "probes; their metrics: forget_nll_ratio, ... and TOFU's names"
            )
        unknown = list(dict.fromkeys(name for name in named if name not in known))
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; known: {', '.join(known)}")


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


MetricValues = dict[str, float | None]


def _absent(value: object) -> bool:
    return value is None


class ResolvedConstraint(BaseModel):
    """A constraint as the search applied it: absolute bounds (a ratio to the base resolved with the
    base model's value on the same probes)."""

    metric: str
    min: float | None = Field(default=None, description="the value at least this")
    max: float | None = Field(default=None, description="the value at most this")
    base: float | None = Field(default=None, description="the base model's value on these probes")


class GoalView(BaseModel):
    metric: str
    sense: Literal["maximize", "minimize"]


class HeldOutCheck(BaseModel):
    """The recommended variant on the probes kept out of the search (held_out_fraction).

    The held-out probes validate the choice: the best candidates are checked in rank order (at most
    four) and the first that meets every bound there is recommended; ``rejected`` lists those that
    did not. A test set the choice never saw stays with the user (evaluate the variant on it)."""

    probes: dict[str, int] = Field(description="per set, the probes held out")
    margins: dict[str, float] = Field(
        default_factory=dict,
        description="per bound (min_<metric> / max_<metric>), how far inside it the recommended variant is on the "
        "held-out probes (negative: outside it by that much)",
    )
    candidate: int | None = Field(default=None, description="the candidate checked and recommended (its index)")
    rejected: list[int] = Field(
        default_factory=list, description="better-ranked candidates that missed a bound on the held-out probes"
    )
    constraints: list[ResolvedConstraint] = Field(description="the bounds, resolved with the base on these probes")
    feasible: bool = Field(description="the recommended variant meets every bound on the held-out probes")
    base: MetricValues = Field(description="the base model's metrics on the held-out probes")
    recommended: MetricValues = Field(description="the recommended variant's metrics on the held-out probes")


class CalibrationCandidate(BaseModel):
    index: int = Field(description="evaluation order")
    options: CandidateOptions
    forget: SplitScore
    retain: SplitScore
    metrics: MetricValues | None = Field(
        default=None, exclude_if=_absent, description="with an objective: every metric measured (objective, bounds, TOFU)"
    )
    feasible: bool = Field(description="it meets the constraint (with an objective: every bound)")
    pareto: bool = Field(description="on the Pareto front: no candidate forgets more without more retain damage")
    stage: Literal["coarse", "fine"] = Field(description="coarse: bracketing the constraint; fine: refining it")
    attacked: dict[str, MetricValues] | None = ATTACKED_FIELD


class CalibrationRecommendation(BaseModel):
    candidate: int
    options: CandidateOptions
    forget_nll_ratio: float | None
    retain_nll_ratio: float
    variant_id: str = Field(description="the candidate built as an unlearn variant (GET /variants/{variant_id})")
    variant_job_id: str | None = None
    format: Literal["checkpoint", "delta", "peft"]
    metrics: MetricValues | None = Field(default=None, exclude_if=_absent, description="with an objective: its metrics")
    forget_exact_match: float | None = Field(
        default=None, description="share of forget probes still answered exactly (image probes: top-1 accuracy)"
    )
    retain_exact_match: float | None = Field(
        default=None, description="share of retain probes answered exactly (image probes: top-1 accuracy)"
    )


class CalibrationResult(BaseModel):
    calibration_id: str
    model_id: str
    concepts: list[str]
    universe_id: str
    reference: list[str]
    constraint: dict[str, float] = Field(
        description="the bounds applied (absolute): max_retain_nll_ratio, or with an objective min_{metric} / max_{metric}"
    )
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
    front_png: str = Field(description="where the drawn front is served (?x=&y= name the metrics plotted)")
    seconds: dict[str, float] = Field(default_factory=dict)
    objective: GoalView | None = Field(default=None, exclude_if=_absent, description="the objective, when one was asked")
    constraints: list[ResolvedConstraint] | None = Field(
        default=None, exclude_if=_absent, description="with an objective: the bounds as applied"
    )
    retain_model: str | None = Field(default=None, exclude_if=_absent, description="the retain model scored against")
    base_metrics: MetricValues | None = Field(
        default=None, exclude_if=_absent, description="with an objective: the base model's metrics on the search's probes"
    )
    retain_metrics: MetricValues | None = Field(
        default=None, exclude_if=_absent, description="with a retain model: its metrics on the search's probes"
    )
    held_out: HeldOutCheck | None = Field(
        default=None, exclude_if=_absent, description="with held_out_fraction: the recommendation checked on unseen probes"
    )
    attack_gate: AttackGate | None = ATTACK_GATE_FIELD
    warnings: list[str] = WARNINGS_FIELD
    perplexity_on: Literal["general", "retain"] | None = PERPLEXITY_ON_FIELD
    truncated_probes: dict[str, int] | None = TRUNCATED_PROBES_FIELD
    retain_probes_in_reference: dict[str, int] | None = RETAIN_PROBES_IN_REFERENCE_FIELD


class Calibration(BaseModel):
    calibration_id: str
    model_id: str
    concepts: list[str]
    universe_id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    job_id: str | None = None
    result: CalibrationResult | None = None


class CalibrationJobResult(CalibrationResult, JobResult):
    """A ``calibrate`` job's result: the calibration's result (``GET /calibrations/{id}``), and whether it was reused."""

    reused: bool = Field(default=False, description="answered from storage: the same calibration ran before")
