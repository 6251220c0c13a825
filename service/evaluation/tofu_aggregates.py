"""TOFU's comparisons across probe sets and models, and the AI Engram paper's aggregates.

Pure numpy/scipy over per-probe values (:mod:`service.evaluation.tofu_probe_metrics`). Names follow
OpenUnlearning (``src/evals/metrics``, read at commit d3d7cf9): ``auc`` of each membership attack,
``privleak``, ``forget_quality`` (``ks_test``), ``model_utility`` (``hm_aggregate``). The aggregates
(Memorization, Utility, Privacy, Overall) follow the paper's appendix (its TOFU table), which takes
them from OpenUnlearning's analysis suite:

* ``safe_hmean(S) = n / Σ 1/max(s, 1e-10)``;
* a memorization value ``x`` is rescaled against the retain model (ideal) and the fine-tuned
  base model: ``clip(|x_unl − x_ret| / |x_ft − x_ret|, 0, 1)``; Memorization is the harmonic
  mean of ``1 −`` the rescaled EM, ES, paraphrased probability and truth ratio;
* model utility is rescaled by the base model's: ``clip(MU_unl / MU_ft, 0, 1)``; Utility is the
  harmonic mean of it and forget fluency (when a fluency classifier gave one);
* each MIA attack's AUC separates the unlearned model's scores on the forget probes from the
  retain model's scores on the same probes; its privacy score is ``1 − 2·|AUC − 0.5|``;
  Privacy is the harmonic mean of the four;
* Overall is the harmonic mean of Memorization, Utility and Privacy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from service.evaluation.tofu_probe_metrics import EPS, Floats, as_floats, nonempty

__all__ = [
    "MemorizationInputs",
    "auc",
    "forget_quality",
    "hm_aggregate",
    "log10_or_neg_inf",
    "memorization_score",
    "model_utility_rescaled",
    "overall_score",
    "privacy_score",
    "privleak",
    "rescaled",
    "safe_hmean",
]


# --- membership inference and forget quality: one probe set against another ------------------


def auc(negative_scores: Sequence[float] | Floats, positive_scores: Sequence[float] | Floats) -> float:
    """Area under the ROC curve of scores labelled 0 (``negative_scores``) against 1: the probability
    that a positive outscores a negative, ties counting one half (the Mann-Whitney statistic,
    what ``sklearn.metrics.roc_auc_score`` returns).

    OpenUnlearning labels the forget probes 0 and the holdout probes 1, so 1 means the forget
    probes look much more like members.

    Raises:
        ValueError: either set is empty (AUC is undefined), naming which.
    """
    neg = nonempty(as_floats(negative_scores, "negative_scores"), "the negative (label 0) score set")
    pos = nonempty(as_floats(positive_scores, "positive_scores"), "the positive (label 1) score set")
    ranks = stats.rankdata(np.concatenate([neg, pos]))  # average ranks: ties count one half
    rank_sum = float(ranks[neg.size :].sum())
    return (rank_sum - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size)


def privleak(auc_value: float, retain_auc: float) -> float:
    """OpenUnlearning's ``privleak`` (in TOFU's default set, on ``mia_min_k``): the relative gap, in
    percent, of ``1 − AUC`` to the retain model's ``1 − AUC`` (0: leaks as much as the retain model)."""
    score, ref = 1.0 - auc_value, 1.0 - retain_auc
    return (score - ref) / (ref + EPS) * 100


def privacy_score(auc_value: float) -> float:
    """``1 − 2·|AUC − 0.5|``: 1 when the attack cannot tell the two sets apart."""
    return 1.0 - 2.0 * abs(auc_value - 0.5)


def forget_quality(model_truth_ratios: Sequence[float] | Floats, retain_truth_ratios: Sequence[float] | Floats) -> float:
    """TOFU's forget quality (OpenUnlearning's ``ks_test``): the two-sample Kolmogorov-Smirnov
    p-value between the per-probe forget truth ratios of the model and of the retain model.

    Raises:
        ValueError: either set is empty, naming which.
    """
    ours = nonempty(as_floats(model_truth_ratios, "model_truth_ratios"), "the model's forget truth ratios")
    theirs = nonempty(as_floats(retain_truth_ratios, "retain_truth_ratios"), "the retain model's forget truth ratios")
    return float(stats.ks_2samp(ours, theirs).pvalue)


# --- aggregates -------------------------------------------------------------------------------------


def hm_aggregate(values: Sequence[float]) -> float:
    """OpenUnlearning's ``hm_aggregate`` (model_utility): ``scipy.stats.hmean`` of the components."""
    array = nonempty(as_floats(values, "values"), "model utility components")
    return float(stats.hmean(array))


def safe_hmean(values: Sequence[float]) -> float:
    """The paper's ``safe_hmean``: ``n / Σ 1/max(s, 1e-10)``.

    Raises:
        ValueError: no values, or a NaN among them.
    """
    array = nonempty(as_floats(values, "values"), "safe_hmean's values")
    if np.isnan(array).any():
        raise ValueError(f"safe_hmean of a NaN: {array.tolist()}")
    return float(array.size / np.sum(1.0 / np.maximum(array, EPS)))


def rescaled(value: float, retain_value: float, base_value: float) -> float:
    """``clip(|x − x_ret| / |x_ft − x_ret|, 0, 1)``: 0 behaves like the retain model, 1 like the base.

    When base and retain agree the metric cannot tell them apart: 0 if the model agrees too, else 1.
    """
    gap, span = abs(value - retain_value), abs(base_value - retain_value)
    if span == 0:
        return 0.0 if gap == 0 else 1.0
    return float(np.clip(gap / span, 0.0, 1.0))


def model_utility_rescaled(value: float, base_value: float) -> float:
    """``clip(MU / MU_ft, 0, 1)``; a base utility of 0 leaves nothing to lose, so 1."""
    if base_value == 0:
        return 1.0
    return float(np.clip(value / base_value, 0.0, 1.0))


@dataclass(frozen=True)
class MemorizationInputs:
    """The four raw forget-set values that Memorization rescales, for one model."""

    exact_memorization: float
    extraction_strength: float
    forget_Q_A_PARA_Prob: float  # noqa: N815  (OpenUnlearning's metric name)
    forget_truth_ratio: float


def memorization_score(model: MemorizationInputs, retain: MemorizationInputs, base: MemorizationInputs) -> dict[str, float]:
    """The rescaled EM, ES, paraphrased probability and truth ratio (``*_rescaled``) and
    ``memorization``, the safe harmonic mean of one minus each."""
    names = ("exact_memorization", "extraction_strength", "forget_Q_A_PARA_Prob", "forget_truth_ratio")
    scores = {
        f"{name}_rescaled": rescaled(getattr(model, name), getattr(retain, name), getattr(base, name)) for name in names
    }
    scores["memorization"] = safe_hmean([1.0 - s for s in scores.values()])
    return scores


def overall_score(aggregates: Mapping[str, float]) -> float:
    """Overall: the safe harmonic mean of ``memorization``, ``utility`` and ``privacy``.

    Raises:
        ValueError: one of the three is missing, naming it.
    """
    missing = [name for name in ("memorization", "utility", "privacy") if name not in aggregates]
    if missing:
        raise ValueError(f"Overall needs memorization, utility and privacy; missing: {', '.join(missing)}")
    return safe_hmean([aggregates["memorization"], aggregates["utility"], aggregates["privacy"]])


def log10_or_neg_inf(p_value: float) -> float:
    """``log10`` of a p-value as the paper reports forget quality (−inf for a p-value of 0)."""
    return math.log10(p_value) if p_value > 0 else -math.inf
