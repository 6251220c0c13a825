"""One model's TOFU table, as OpenUnlearning reports it, and its scores against the retain and base models.

:func:`model_report` computes a model's raw values on its forget, retain, utility and holdout
probes from per-probe statistics (:mod:`service.engine.tofu_scoring` produces them), with the
per-probe quantities of :mod:`service.evaluation.tofu_probe_metrics`; :func:`tofu_scores` adds the
comparisons with the retain model (trained without the forget set) and the base model (fine-tuned
on everything) and the paper's aggregates, from :mod:`service.evaluation.tofu_aggregates`. What
cannot be computed (a missing probe field, probe set or model) is named in ``left_out``, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from service.engine.tofu_statistics import ProbeStatistics
from service.evaluation.tofu_aggregates import (
    MemorizationInputs,
    auc,
    forget_quality,
    hm_aggregate,
    log10_or_neg_inf,
    memorization_score,
    model_utility_rescaled,
    overall_score,
    privacy_score,
    privleak,
    safe_hmean,
)
from service.evaluation.tofu_probe_metrics import (
    TOFU_MIN_K,
    Floats,
    exact_memorization,
    extraction_strength,
    min_k_plus_plus_score,
    min_k_score,
    probability,
    probability_w_options,
    rouge_l_recall,
    truth_ratio,
    truth_ratio_values,
    zlib_score,
)

__all__ = [
    "MIA_ATTACKS",
    "NEEDS_GENERATION",
    "NEEDS_PARAPHRASE",
    "NEEDS_PERTURBED",
    "ModelReport",
    "mia_scores",
    "model_report",
    "tofu_scores",
]

MIA_ATTACKS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")

NEEDS_PARAPHRASE = "needs paraphrased_answer on every probe"
NEEDS_PERTURBED = "needs perturbed_answers on every probe"
NEEDS_GENERATION = "needs greedy generations (generate=True)"


@dataclass(frozen=True)
class ModelReport:
    """One model's raw TOFU values, and the per-probe arrays that scores against another model read.

    ``left_out`` names each metric that could not be computed and why (a missing probe field or set).
    """

    values: dict[str, float]
    left_out: dict[str, str]
    forget_truth_ratios: Floats | None  # per forget probe, TOFU's p_wrong / p_true (forget quality)
    forget_mia_scores: dict[str, Floats]  # attack -> per forget probe score (privacy against the retain model)


def mia_scores(probes: Sequence[ProbeStatistics], k: float = TOFU_MIN_K) -> dict[str, Floats]:
    """Per-probe scores of the four attacks (each signed like a loss: higher, less likely a member)."""
    return {
        "mia_loss": np.array([p.answer.avg_loss for p in probes], dtype=np.float64),
        "mia_zlib": np.array([zlib_score(p.answer.avg_loss, p.answer_text) for p in probes], dtype=np.float64),
        "mia_min_k": np.array([min_k_score(p.answer.logprobs, k) for p in probes], dtype=np.float64),
        "mia_min_k_plus_plus": np.array(
            [min_k_plus_plus_score(p.answer.logprobs, p.answer.vocab_mean, p.answer.vocab_var, k) for p in probes],
            dtype=np.float64,
        ),
    }


def _missing(probes: Sequence[ProbeStatistics], paraphrase: bool, perturbed: bool) -> str | None:
    if paraphrase and any(p.paraphrased is None for p in probes):
        return NEEDS_PARAPHRASE
    if perturbed and any(p.perturbed is None for p in probes):
        return NEEDS_PERTURBED
    return None


def _wrong_losses(probes: Sequence[ProbeStatistics]) -> list[list[float]]:
    return [[w.avg_loss for w in p.perturbed or ()] for p in probes]


def _rouge(probes: Sequence[ProbeStatistics]) -> float | None:
    if any(p.generation is None for p in probes):
        return None
    return float(np.mean([rouge_l_recall(p.generation or "", p.answer_text) for p in probes]))


def _set_values(
    prefix: str, probes: Sequence[ProbeStatistics], correct_is_paraphrase: bool
) -> tuple[dict[str, float], dict[str, str]]:
    """A retain or utility set's three model-utility components (TOFU's ``retain_*``, ``ra_*``, ``wf_*``).

    The retain set compares the paraphrase with the wrong answers in its truth ratio and reports
    the answer's probability; the utility sets (real authors, world facts) compare the answer itself,
    and normalise its probability by the wrong ones'.
    """
    values: dict[str, float] = {}
    left_out: dict[str, str] = {}
    answer_losses = [p.answer.avg_loss for p in probes]
    if correct_is_paraphrase:
        values[f"{prefix}_Q_A_Prob"] = probability(answer_losses)
    elif (why := _missing(probes, False, True)) is not None:
        left_out[f"{prefix}_Q_A_Prob_normalised"] = why
    else:
        values[f"{prefix}_Q_A_Prob_normalised"] = probability_w_options(answer_losses, _wrong_losses(probes))
    rouge = _rouge(probes)
    if rouge is None:
        left_out[f"{prefix}_Q_A_ROUGE"] = NEEDS_GENERATION
    else:
        values[f"{prefix}_Q_A_ROUGE"] = rouge
    if (why := _missing(probes, correct_is_paraphrase, True)) is not None:
        left_out[f"{prefix}_Truth_Ratio"] = why
    else:
        correct = (
            [p.paraphrased.avg_loss if p.paraphrased else 0.0 for p in probes] if correct_is_paraphrase else answer_losses
        )
        ratios = truth_ratio_values(correct, _wrong_losses(probes), "true_better")
        values[f"{prefix}_Truth_Ratio"] = truth_ratio(ratios, "true_better")
    return values, left_out


def _forget_values(
    forget: Sequence[ProbeStatistics], holdout: Sequence[ProbeStatistics] | None
) -> tuple[dict[str, float], dict[str, str], Floats | None]:
    values = {
        "exact_memorization": float(np.mean([exact_memorization(p.answer.argmax_hits) for p in forget])),
        "extraction_strength": float(np.mean([extraction_strength(p.answer.argmax_hits) for p in forget])),
        "forget_Q_A_Prob": probability([p.answer.avg_loss for p in forget]),
    }
    left_out: dict[str, str] = {}
    rouge = _rouge(forget)
    if rouge is None:
        left_out["forget_Q_A_ROUGE"] = NEEDS_GENERATION
    else:
        values["forget_Q_A_ROUGE"] = rouge
    if (why := _missing(forget, True, False)) is not None:
        left_out["forget_Q_A_PARA_Prob"] = why
    else:
        values["forget_Q_A_PARA_Prob"] = probability([p.paraphrased.avg_loss for p in forget if p.paraphrased])
    if (why := _missing(forget, False, True)) is not None:
        left_out["forget_Q_A_PERT_Prob"] = why
    else:
        # OpenUnlearning averages a probe's wrong-answer probabilities, then the probes
        values["forget_Q_A_PERT_Prob"] = float(np.mean([np.mean(np.exp(-np.array(w))) for w in _wrong_losses(forget)]))
    ratios: Floats | None = None
    if (why := _missing(forget, True, True)) is not None:
        left_out["forget_truth_ratio"] = why
    else:
        correct = [p.paraphrased.avg_loss for p in forget if p.paraphrased]
        ratios = truth_ratio_values(correct, _wrong_losses(forget), "closer_to_1_better")
        values["forget_truth_ratio"] = truth_ratio(ratios, "closer_to_1_better")
    if holdout:
        forget_scores, holdout_scores = mia_scores(forget), mia_scores(holdout)
        for attack in MIA_ATTACKS:
            values[attack] = auc(forget_scores[attack], holdout_scores[attack])
    else:
        left_out.update(dict.fromkeys(MIA_ATTACKS, "needs holdout probes (facts the model never saw)"))
    return values, left_out, ratios


def model_report(
    forget: Sequence[ProbeStatistics],
    retain: Sequence[ProbeStatistics] | None = None,
    utility: Mapping[str, Sequence[ProbeStatistics]] | None = None,
    holdout: Sequence[ProbeStatistics] | None = None,
) -> ModelReport:
    """One model's raw values on the forget probes, the retain probes and any named utility sets.

    ``model_utility`` is ``hm_aggregate`` of every component that could be computed (TOFU's nine
    when retain, ``ra`` and ``wf`` sets are given with every field); the rest are in ``left_out``.

    Raises:
        ValueError: no forget probes.
    """
    if not forget:
        raise ValueError("the forget probe set is empty")
    values, left_out, ratios = _forget_values(forget, holdout)
    components: dict[str, float] = {}
    sets = [("retain", retain, True)] if retain else []
    sets += [(name, probes, False) for name, probes in (utility or {}).items() if probes]
    for prefix, probes, is_retain in sets:
        set_values, set_left_out = _set_values(prefix, probes, is_retain)
        components.update(set_values)
        left_out.update(set_left_out)
    values.update(components)
    if components:
        values["model_utility"] = hm_aggregate(list(components.values()))
    else:
        left_out["model_utility"] = "needs retain or utility probes"
    return ModelReport(values, left_out, ratios, mia_scores(forget))


def tofu_scores(model: ModelReport, retain: ModelReport | None, base: ModelReport | None) -> ModelReport:
    """``model``'s values with the scores that compare it with the retain model (trained without the
    forget set) and the base model (fine-tuned on everything, before unlearning): forget quality,
    the rescaled memorization values, the privacy scores, the aggregates and Overall.

    What cannot be computed (no retain or base report, a raw value missing) is named in
    ``left_out``. Forget fluency needs a fluency classifier, which is not run here: ``utility`` is
    then the rescaled model utility alone.
    """
    values, left_out = dict(model.values), dict(model.left_out)
    left_out["forget_fluency"] = "needs a fluency classifier"
    if retain is None:
        for name in ("forget_quality", "memorization", "privacy", "overall"):
            left_out[name] = "needs a retain model"
    else:
        values.update(_against_retain(model, retain, base, left_out))
    if base is None or "model_utility" not in values or "model_utility" not in base.values:
        left_out["utility"] = "needs model_utility of the model and of the base model"
    else:
        values["model_utility_rescaled"] = model_utility_rescaled(values["model_utility"], base.values["model_utility"])
        values["utility"] = safe_hmean([values["model_utility_rescaled"]])
    if all(name in values for name in ("memorization", "utility", "privacy")):
        values["overall"] = overall_score(values)
    else:
        missing = [n for n in ("memorization", "utility", "privacy") if n not in values]
        left_out["overall"] = f"needs {', '.join(missing)}"
    return ModelReport(values, left_out, model.forget_truth_ratios, model.forget_mia_scores)


def _against_retain(
    model: ModelReport, retain: ModelReport, base: ModelReport | None, left_out: dict[str, str]
) -> dict[str, float]:
    values: dict[str, float] = {}
    if model.forget_truth_ratios is None or retain.forget_truth_ratios is None:
        left_out["forget_quality"] = "needs forget truth ratios of the model and the retain model"
    else:
        values["forget_quality"] = forget_quality(model.forget_truth_ratios, retain.forget_truth_ratios)
        values["forget_quality_log10"] = log10_or_neg_inf(values["forget_quality"])
    if "mia_min_k" in model.values and "mia_min_k" in retain.values:
        values["privleak"] = privleak(model.values["mia_min_k"], retain.values["mia_min_k"])
    else:
        left_out["privleak"] = "needs mia_min_k (holdout probes) of the model and the retain model"
    for attack in MIA_ATTACKS:
        area = auc(model.forget_mia_scores[attack], retain.forget_mia_scores[attack])
        values[f"{attack}_auc_vs_retain"] = area
        values[f"privacy_{attack}"] = privacy_score(area)
    values["privacy"] = safe_hmean([values[f"privacy_{attack}"] for attack in MIA_ATTACKS])
    names = ("exact_memorization", "extraction_strength", "forget_Q_A_PARA_Prob", "forget_truth_ratio")
    reports = {"model": model.values, "retain": retain.values, "base": base.values if base else {}}
    absent = [f"{who}'s {n}" for who, v in reports.items() for n in names if n not in v]
    if absent:
        left_out["memorization"] = f"needs {', '.join(absent)}"
        return values
    inputs = {who: MemorizationInputs(*(v[n] for n in names)) for who, v in reports.items()}
    values.update(memorization_score(inputs["model"], inputs["retain"], inputs["base"]))
    return values
