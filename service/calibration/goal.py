"""A calibration's objective and constraints on named metrics: checked at submission, stored, resolved.

A request with an ``objective`` (:class:`api_schemas.calibration.Objective`) is searched by
:mod:`service.calibration.goal_search` on the metrics each candidate is measured on: the
calibration's own (NLL ratios, exact match) and TOFU's suite as ``evaluate`` reports it
(:mod:`service.evaluation.tofu_metrics`). What a metric needs (a retain model, paraphrased or
perturbed answers on the probes, holdout facts) is found by running that very suite on placeholder
statistics shaped like the request's probes, so the refusal at submission names exactly what the
job would have left out, with the suite's own reason.

The stored form (:class:`GoalSpec`, ``goal`` in ``request.json``) is a frozen record; a request
without an objective stores none, so its ID and its answer are what they were before.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.attacks import RelearnAttack, relearn_rows
from api_schemas.calibration import (
    CALIBRATION_METRICS,
    CLASSIFIER_METRICS,
    DEFAULT_RETAIN_ACCURACY_RATIO,
    CalibrateRequest,
)
from api_schemas.calibration_attacks import AttackConstraint
from api_schemas.calibration_default import DEFAULT_HELD_OUT_FRACTION
from api_schemas.evaluation import Probe
from service.calibration.goal_search import Bound, Goal
from service.engine.tofu_statistics import AnswerTokens, ProbeStatistics
from service.errors import InvalidInput
from service.evaluation import tofu_metrics as tm
from service.evaluation.retain_model import RetainModelRef

SPLIT_SEED = 0  # the held-out split's seed: the same request, the same split
# Shares of probes (0 to 1) that a floor relative to the base may be put on when the base scores 0 (a
# model that answers none of the retain probes exactly is still calibrated: its floor is 0).
SHARES = frozenset({"retain_exact_match", "forget_exact_match", "retain_accuracy", "forget_accuracy", "test_accuracy"})


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ConstraintSpec(_Frozen):
    """One constraint as asked (absolute bounds and bounds relative to the base model's value)."""

    metric: str
    min: float | None = None
    max: float | None = None
    min_ratio_to_base: float | None = None
    max_ratio_to_base: float | None = None

    def bound(self, base: Mapping[str, float]) -> Bound:
        """The absolute bound: a ratio times the base model's value (on the same probes), the tighter
        of it and an absolute bound where both are given.

        Raises:
            ValueError: a ratio to a base value that is missing, not finite or not positive.
        """
        lows = [self.min] if self.min is not None else []
        highs = [self.max] if self.max is not None else []
        if self.min_ratio_to_base is not None or self.max_ratio_to_base is not None:
            value = base.get(self.metric)
            if value == 0 and self.max_ratio_to_base is None and self.metric in SHARES:
                value = 0.0  # a share the base scores 0 on: the floor "ratio × 0" is 0, met by every candidate
            elif value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(f"a bound relative to the base needs the base's {self.metric} positive; it is {value}")
            if self.min_ratio_to_base is not None:
                lows.append(self.min_ratio_to_base * value)
            if self.max_ratio_to_base is not None:
                highs.append(self.max_ratio_to_base * value)
        return Bound(self.metric, max(lows) if lows else None, min(highs) if highs else None)


class GoalSpec(_Frozen):
    """What a calibration with an objective stores as ``goal`` (and its ID digests)."""

    objective: str
    sense: Literal["maximize", "minimize"]
    constraints: tuple[ConstraintSpec, ...] = ()
    retain_model: RetainModelRef | None = None
    held_out_fraction: float | None = None
    utility_sets: tuple[str, ...] = ()
    # "image": an image classifier's calibration (its metrics, :mod:`service.calibration.classifier_goal`);
    # "exact_match": a text calibration's default objective (the calibration's own metrics only, no TOFU
    # suite). Absent for a text objective, so its stored form (and its calibration's ID) is what it was.
    kind: Literal["image", "exact_match"] | None = Field(default=None, exclude_if=lambda v: v is None)
    # The attack gate (:mod:`service.calibration.goal_attacks`); absent without one, so the stored form
    # of a calibration without attack constraints (and its ID) is unchanged.
    attacks: tuple[AttackConstraint, ...] = Field(default=(), exclude_if=lambda v: not v)

    def goal(self, base: Mapping[str, float]) -> Goal:
        """The search's goal, its bounds resolved against the base model's metrics."""
        return Goal(self.objective, self.sense, tuple(c.bound(base) for c in self.constraints))

    @property
    def metrics(self) -> list[str]:
        """The objective's and the constraints' metrics, each once."""
        return list(dict.fromkeys([self.objective, *(c.metric for c in self.constraints)]))


def goal_spec(options: CalibrateRequest, retain_model: RetainModelRef | None) -> GoalSpec | None:
    """The stored goal of a request (None without an objective). An explicitly set
    ``max_retain_nll_ratio`` becomes a constraint on ``retain_nll_ratio``."""
    if options.kind == "image":
        return classifier_goal_spec(options, retain_model)
    if options.objective is None:
        if "max_retain_nll_ratio" in options.model_fields_set:
            return None  # the NLL-ratio search, as before objectives
        return exact_match_goal_spec(options)
    constraints = [ConstraintSpec(**c.model_dump(exclude_none=True)) for c in options.constraints]
    if "max_retain_nll_ratio" in options.model_fields_set:
        constraints.append(ConstraintSpec(metric="retain_nll_ratio", max=options.max_retain_nll_ratio))
    return GoalSpec(
        objective=options.objective.metric,
        sense=options.objective.sense,
        constraints=tuple(constraints),
        retain_model=retain_model,
        held_out_fraction=options.held_out_fraction,
        utility_sets=tuple(options.utility),
        attacks=checked_attacks(options, options.held_out_fraction),
    )


def exact_match_goal_spec(options: CalibrateRequest) -> GoalSpec:
    """A text calibration's default goal: the lowest ``forget_exact_match`` with ``retain_exact_match``
    ≥ the floor × the base's and ``perplexity_ratio`` ≤ the bound (on ``utility.general``, else on the
    retain answers), a share of the probes held out to check the choice
    (:mod:`api_schemas.calibration_default`)."""
    constraints = (
        ConstraintSpec(metric="retain_exact_match", min_ratio_to_base=options.min_retain_exact_match_ratio),
        ConstraintSpec(metric="perplexity_ratio", max=options.max_perplexity_ratio),
    )
    fraction = options.held_out_fraction if options.held_out_fraction is not None else DEFAULT_HELD_OUT_FRACTION
    return GoalSpec(
        objective="forget_exact_match",
        sense="minimize",
        constraints=constraints,
        held_out_fraction=fraction,
        utility_sets=tuple(options.utility),
        kind="exact_match",
        attacks=checked_attacks(options, fraction),
    )


def checked_attacks(options: CalibrateRequest, fraction: float | None) -> tuple[AttackConstraint, ...]:
    """The request's attack constraints, refused (422) where the held-out probes cannot check them:
    forget and retain probes held out, and for relearn on probes one held-out forget probe to train on
    and one to score."""
    attacks = tuple(options.attack_constraints)
    if not attacks:
        return attacks
    _, forget = held_out_split(options.forget, fraction)
    _, retain = held_out_split(options.retain, fraction)
    if not forget or not retain:
        raise InvalidInput(
            "attack_constraints are checked on held-out probes, and these hold none out: send two or more forget "
            "and retain probes"
        )
    for constraint in attacks:
        attack = constraint.attack
        if isinstance(attack, RelearnAttack) and attack.texts is None:
            trained = relearn_rows(attack, len(forget))
            if not 1 <= trained < len(forget):
                raise InvalidInput(
                    f"attack relearn trains on {trained} of the {len(forget)} held-out forget probes and scores the "
                    "rest: it needs one of each; send more forget probes, raise held_out_fraction, set train_probes "
                    "below the held-out count, or send texts to train on"
                )
    return attacks


def classifier_goal_spec(options: CalibrateRequest, retain_model: RetainModelRef | None) -> GoalSpec:
    """An image classifier's goal: the request's objective, or the default one (the lowest
    ``forget_accuracy`` with ``retain_accuracy`` ≥ 0.9 × the base's when no constraint is given; given a
    retrained model, the highest ``tow``, which weighs the retain and test accuracies itself)."""
    constraints = [ConstraintSpec(**c.model_dump(exclude_none=True)) for c in options.constraints]
    if options.objective is not None:
        objective, sense = options.objective.metric, options.objective.sense
    elif retain_model is not None:
        objective, sense = "tow", "maximize"
    else:
        objective, sense = "forget_accuracy", "minimize"
        if not constraints:
            constraints = [ConstraintSpec(metric="retain_accuracy", min_ratio_to_base=DEFAULT_RETAIN_ACCURACY_RATIO)]
    return GoalSpec(
        objective=objective,
        sense=sense,
        constraints=tuple(constraints),
        retain_model=retain_model,
        held_out_fraction=options.held_out_fraction,
        kind="image",
    )


def unavailable_classifier_metrics(metrics: Sequence[str], has_test: bool, has_retain_model: bool) -> dict[str, str]:
    """The named classifier metrics the request cannot measure, each with the reason."""
    missing: dict[str, str] = {}
    for name in metrics:
        needs = []
        if name == "tow" or name.startswith("cka_to_retrained_"):
            needs += [] if has_retain_model else ["retain_model (the classifier retrained without the forget classes)"]
        if name == "tow" or name.endswith("_test") or name.startswith("test_"):
            needs += [] if has_test else ["test probes (labelled images of every class)"]
        if needs:
            missing[name] = "needs " + " and ".join(needs)
        elif name not in CLASSIFIER_METRICS:
            missing[name] = "is no metric of an image classifier"
    return missing


# ---------------------------------------------------------------- what a metric needs


def _placeholder(probes: Sequence[Probe], n: int = 3) -> list[ProbeStatistics]:
    """Statistics shaped like ``probes``: a paraphrase (perturbed answers) where every probe has one."""
    tokens = AnswerTokens((-1.0, -2.0), (-3.0, -3.0), (1.0, 1.0), (True, False))
    para = all(p.paraphrased_answer is not None for p in probes)
    wrong = all(p.perturbed_answers is not None for p in probes)
    return [
        ProbeStatistics(
            answer=tokens,
            answer_text="a b",
            paraphrased=tokens if para else None,
            perturbed=(tokens, tokens) if wrong else None,
            generation="a b",
        )
        for _ in range(n)
    ]


def unavailable_metrics(options: CalibrateRequest, metrics: Sequence[str], has_retain_model: bool) -> dict[str, str]:
    """The named metrics the request cannot measure, each with the suite's reason."""
    tofu = [m for m in metrics if m not in CALIBRATION_METRICS]
    if not tofu:
        return {}
    utility = {name: _placeholder(items) for name, items in options.utility.items()}
    holdout = _placeholder(options.holdout) if options.holdout else None
    report = tm.model_report(_placeholder(options.forget), _placeholder(options.retain), utility, holdout)
    scored = tm.tofu_scores(report, report if has_retain_model else None, report)
    return {m: _reason(m, scored.left_out) for m in tofu if m not in scored.values}


def _reason(name: str, left_out: Mapping[str, str], depth: int = 0) -> str:
    """The suite's reason, with the reasons of the aggregates it names (overall needs privacy, which
    needs a retain model)."""
    reason = left_out.get(name, "is not computed by the TOFU suite")
    if depth > 3 or not reason.startswith("needs "):
        return reason
    parts = [part.strip() for part in reason[len("needs ") :].split(",")]
    nested = [f"{part} {_reason(part, left_out, depth + 1)}" for part in parts if part in left_out and part != name]
    return reason + (f" ({'; '.join(nested)})" if nested else "")


def check_measurable(options: CalibrateRequest, has_retain_model: bool) -> None:
    """422 naming each objective or constraint metric the request cannot measure, and why."""
    if options.kind == "image":
        spec = classifier_goal_spec(options, None)
        implied = (
            "" if options.objective is not None else f" (with no objective, the calibration {spec.sense}s {spec.objective})"
        )
        if options.objective is None and has_retain_model:
            implied = " (with no objective and a retain_model, the calibration maximizes tow)"
            spec = spec.model_copy(update={"objective": "tow"})
        missing = unavailable_classifier_metrics(spec.metrics, bool(options.test), has_retain_model)
        if missing:
            why = "; ".join(f"{name} {reason}" for name, reason in missing.items())
            raise InvalidInput(f"the calibration cannot measure {', '.join(missing)}{implied}: {why}")
        return
    if options.objective is None:
        return
    named = [options.objective.metric, *(c.metric for c in options.constraints)]
    missing = unavailable_metrics(options, list(dict.fromkeys(named)), has_retain_model)
    if missing:
        why = "; ".join(f"{name} {reason}" for name, reason in missing.items())
        raise InvalidInput(
            f"the calibration cannot measure {', '.join(missing)}: {why} (give retain_model, or probes with "
            "paraphrased_answer and perturbed_answers, or holdout probes, as the metric needs)"
        )


# ---------------------------------------------------------------- the held-out split


def held_out_split(items: Sequence[Any], fraction: float | None) -> tuple[list[Any], list[Any]]:
    """``(searched, held out)``: ``round(fraction·n)`` probes held out, at least one and leaving at
    least one, chosen by a fixed seed (a set of one probe is not split: it is searched on)."""
    if fraction is None or len(items) < 2:
        return list(items), []
    n_out = min(max(1, round(fraction * len(items))), len(items) - 1)
    out = set(random.Random(SPLIT_SEED).sample(range(len(items)), n_out))
    return [p for i, p in enumerate(items) if i not in out], [p for i, p in enumerate(items) if i in out]
