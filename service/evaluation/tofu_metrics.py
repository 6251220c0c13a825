"""TOFU's unlearning metrics, as OpenUnlearning computes them, from per-probe statistics.

Everything here is pure numpy/scipy over numbers a model already produced
(:mod:`service.engine.tofu_scoring` produces them): no model, no torch. Names follow
OpenUnlearning (``locuslab/open-unlearning``, ``src/evals/metrics``, read at commit d3d7cf9):
``exact_memorization``, ``extraction_strength``, ``probability``, ``probability_w_options``,
``truth_ratio``, ``rouge`` (rougeL_recall), ``model_utility`` (``hm_aggregate``), ``mia_loss``,
``mia_zlib``, ``mia_min_k``, ``mia_min_k_plus_plus``, ``forget_quality`` (``ks_test``).
The aggregates (Memorization, Utility, Privacy, Overall) follow the AI Engram paper's appendix
(its TOFU table), which takes them from OpenUnlearning's analysis suite:

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

Where this differs from OpenUnlearning, and why:

* The answer tokens are the completion as the statistics collector tokenizes it (no end-of-text
  token). OpenUnlearning's probability and loss include the end token of its chat-rendered
  answer; its EM, ES and min-k drop that last label, so on a plain completion they agree.
* ROUGE-L recall uses rouge_score's tokenization (lower case, runs of ``[a-z0-9]``) without
  the Porter stemmer (the stemmer needs nltk, not a dependency here): an inflected word that the
  stemmer would match counts as a miss.
* ROUGE's generation is greedy and as long as the answer in tokens, cut at the end token
  (:mod:`service.engine.tofu_scoring`); OpenUnlearning decodes up to 200 tokens to the end token.
* Extraction strength keeps OpenUnlearning's loop exactly: when not even the last token is
  predicted, its ``k`` ends at ``len − 1`` and ES is ``1/len``, not 0.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from scipy import stats

from service.engine.tofu_statistics import ProbeStatistics

__all__ = [
    "MIA_ATTACKS",
    "MemorizationInputs",
    "ModelReport",
    "log10_or_neg_inf",
    "mia_scores",
    "model_report",
    "tofu_scores",
    "TruthRatioAggregator",
    "auc",
    "avg_loss",
    "exact_memorization",
    "extraction_strength",
    "forget_quality",
    "hm_aggregate",
    "memorization_score",
    "min_k_score",
    "min_k_plus_plus_score",
    "model_utility_rescaled",
    "overall_score",
    "privacy_score",
    "privleak",
    "probability",
    "probability_w_options",
    "rescaled",
    "rouge_l_recall",
    "safe_hmean",
    "truth_ratio",
    "truth_ratio_values",
    "zlib_score",
]

Floats = npt.NDArray[np.float64]

# OpenUnlearning's guard against division by zero, used in the truth ratio and probability_w_options.
EPS = 1e-10
# OpenUnlearning's TOFU configs run min-k and min-k++ with k = 0.4 (configs/eval/tofu_metrics).
TOFU_MIN_K = 0.4
MIA_ATTACKS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")

TruthRatioAggregator = Literal["closer_to_1_better", "true_better", "prob_mean"]


def _floats(values: Sequence[float] | Floats, name: str) -> Floats:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _nonempty(values: Floats, name: str) -> Floats:
    if values.size == 0:
        raise ValueError(f"{name} is empty: the metric needs at least one probe")
    return values


# --- per-probe quantities -------------------------------------------------------------------------


def avg_loss(token_logprobs: Sequence[float] | Floats) -> float:
    """Mean negative log-likelihood (nats/token) of an answer from its tokens' log-probabilities.

    Raises:
        ValueError: no tokens (an answer must have at least one).
    """
    logprobs = _nonempty(_floats(token_logprobs, "token_logprobs"), "token_logprobs")
    return float(-logprobs.mean())


def probability(avg_losses: Sequence[float] | Floats) -> float:
    """OpenUnlearning's ``probability``: the mean over probes of ``exp(−avg_loss)``, the answer's
    probability normalised by its length (a geometric mean per token)."""
    losses = _nonempty(_floats(avg_losses, "avg_losses"), "avg_losses")
    return float(np.mean(np.exp(-losses)))


def exact_memorization(argmax_hits: Sequence[bool] | npt.NDArray[np.bool_]) -> float:
    """One probe's EM: the fraction of answer tokens that the model's argmax predicts under teacher
    forcing (OpenUnlearning's ``exact_memorization``; the probe set's value is the mean).

    Raises:
        ValueError: no tokens (OpenUnlearning records ``None`` and leaves the probe out).
    """
    hits = np.asarray(argmax_hits, dtype=bool)
    if hits.size == 0:
        raise ValueError("argmax_hits is empty: EM needs at least one answer token")
    return float(hits.sum() / hits.size)


def extraction_strength(argmax_hits: Sequence[bool] | npt.NDArray[np.bool_]) -> float:
    """One probe's ES: ``1 − k/len`` for the smallest ``k`` from which every later answer token is
    the model's argmax (teacher forcing), as OpenUnlearning's loop computes it (see the module
    docstring for the case where no suffix matches).

    Raises:
        ValueError: no tokens.
    """
    hits = np.asarray(argmax_hits, dtype=bool)
    n = hits.size
    if n == 0:
        raise ValueError("argmax_hits is empty: ES needs at least one answer token")
    # suffix_ok[k]: tokens k..n-1 all hit; the first such k, else OpenUnlearning's last k (n - 1)
    suffix_ok = np.flip(np.cumprod(np.flip(hits))).astype(bool)
    matching = np.flatnonzero(suffix_ok)
    k = int(matching[0]) if matching.size else n - 1
    return 1.0 - k / n


def truth_ratio_values(
    correct_avg_loss: Sequence[float] | Floats,
    wrong_avg_losses: Sequence[Sequence[float]],
    aggregator: TruthRatioAggregator,
) -> Floats:
    """Per-probe truth ratios. The wrong answers' losses are averaged first (OpenUnlearning's
    ``aggregate_to_1D``), so ``p_wrong = exp(−mean loss)``; ``p_true = exp(−correct loss)``.

    TOFU's ratio (``closer_to_1_better``, ``true_better``) is ``p_wrong / (p_true + 1e-10)``;
    ``prob_mean`` uses OpenUnlearning's ``p_true / (p_true + p_wrong + 1e-10)``.

    Raises:
        ValueError: the lists differ in length, or a probe has no wrong answer.
    """
    correct = _floats(correct_avg_loss, "correct_avg_loss")
    if len(wrong_avg_losses) != correct.size:
        raise ValueError(f"{correct.size} correct losses but {len(wrong_avg_losses)} lists of wrong ones")
    if any(len(w) == 0 for w in wrong_avg_losses):
        raise ValueError("a probe has no perturbed (wrong) answer: the truth ratio needs at least one")
    wrong = np.array([np.mean(np.asarray(w, dtype=np.float64)) for w in wrong_avg_losses], dtype=np.float64)
    p_true, p_wrong = np.exp(-correct), np.exp(-wrong)
    if aggregator == "prob_mean":
        return np.asarray(p_true / (p_true + p_wrong + EPS), dtype=np.float64)
    return np.asarray(p_wrong / (p_true + EPS), dtype=np.float64)


def truth_ratio(values: Sequence[float] | Floats, aggregator: TruthRatioAggregator) -> float:
    """OpenUnlearning's ``truth_ratio`` aggregate of per-probe ratios.

    ``closer_to_1_better`` (forget set): ``mean(min(tr, 1/(tr + 1e-10)))``, 1 when true and wrong
    answers are equally likely. ``true_better`` (retain and utility sets): ``mean(max(0, 1 − tr))``.
    ``prob_mean``: the plain mean (of ``p_true / (p_true + p_wrong)``).
    """
    tr = _nonempty(_floats(values, "values"), "truth ratios")
    if aggregator == "closer_to_1_better":
        return float(np.mean(np.minimum(tr, 1 / (tr + EPS))))
    if aggregator == "true_better":
        return float(np.mean(np.maximum(0, 1 - tr)))
    if aggregator == "prob_mean":
        return float(np.mean(tr))
    raise ValueError(f"unknown truth ratio aggregator {aggregator!r}")


def probability_w_options(correct_avg_loss: Sequence[float] | Floats, wrong_avg_losses: Sequence[Sequence[float]]) -> float:
    """OpenUnlearning's ``probability_w_options`` (TOFU's ``*_Q_A_Prob_normalised``): the mean over
    probes of ``p_true / (p_true + Σ p_wrong + 1e-10)``, each ``p = exp(−avg_loss)``.

    Raises:
        ValueError: the lists differ in length, or a probe has no wrong answer.
    """
    correct = _nonempty(_floats(correct_avg_loss, "correct_avg_loss"), "correct_avg_loss")
    if len(wrong_avg_losses) != correct.size:
        raise ValueError(f"{correct.size} correct losses but {len(wrong_avg_losses)} lists of wrong ones")
    if any(len(w) == 0 for w in wrong_avg_losses):
        raise ValueError("a probe has no perturbed (wrong) answer: probability_w_options needs one")
    p_true = np.exp(-correct)
    p_wrong = np.array([np.exp(-np.asarray(w, dtype=np.float64)).sum() for w in wrong_avg_losses])
    return float(np.mean(p_true / (p_true + p_wrong + EPS)))


_ROUGE_TOKEN = re.compile(r"[a-z0-9]+")


def _rouge_tokens(text: str) -> list[str]:
    # rouge_score's tokenize: lower case, every run of other characters is a separator
    return _ROUGE_TOKEN.findall(text.lower())


def rouge_l_recall(generation: str, reference: str) -> float:
    """ROUGE-L recall of a generation against the reference answer: the longest common
    subsequence of their tokens over the reference's token count (0 for an empty reference)."""
    gen, ref = _rouge_tokens(generation), _rouge_tokens(reference)
    if not gen or not ref:
        return 0.0
    # one row of the LCS table at a time: previous[j] = LCS(ref[:i-1], gen[:j])
    previous = [0] * (len(gen) + 1)
    for ref_token in ref:
        current = [0] * (len(gen) + 1)
        for j, gen_token in enumerate(gen, start=1):
            current[j] = previous[j - 1] + 1 if ref_token == gen_token else max(previous[j], current[j - 1])
        previous = current
    return previous[-1] / len(ref)


# --- membership inference: per-sample scores (higher = less likely a member, as a loss) ----------


def zlib_score(avg_loss_value: float, text: str) -> float:
    """OpenUnlearning's zlib attack: the loss over the zlib-compressed byte length of the answer text."""
    return avg_loss_value / len(zlib.compress(text.encode("utf-8")))


def _bottom_k_mean(values: Floats, k: float) -> float:
    num_k = max(1, int(len(values) * k))
    return float(-np.mean(np.sort(values)[:num_k]))


def min_k_score(token_logprobs: Sequence[float] | Floats, k: float = TOFU_MIN_K) -> float:
    """Min-k% prob: minus the mean of the lowest ``max(1, int(len·k))`` token log-probabilities
    (0 for no tokens, as OpenUnlearning)."""
    logprobs = _floats(token_logprobs, "token_logprobs")
    if logprobs.size == 0:
        return 0.0
    return _bottom_k_mean(logprobs, k)


def min_k_plus_plus_score(
    token_logprobs: Sequence[float] | Floats,
    vocab_mean: Sequence[float] | Floats,
    vocab_var: Sequence[float] | Floats,
    k: float = TOFU_MIN_K,
) -> float:
    """Min-k%++: each token's log-probability standardised by the next-token distribution,
    ``(log p(x_t) − μ_t) / σ_t`` with ``μ_t = E[log p]``, ``σ_t² = Var[log p]`` (clamped at 1e-6 as
    OpenUnlearning), then the min-k mean of those."""
    logprobs = _floats(token_logprobs, "token_logprobs")
    mu, var = _floats(vocab_mean, "vocab_mean"), _floats(vocab_var, "vocab_var")
    if not logprobs.size == mu.size == var.size:
        raise ValueError(f"lengths differ: {logprobs.size} log-probs, {mu.size} means, {var.size} variances")
    if logprobs.size == 0:
        return 0.0
    return _bottom_k_mean((logprobs - mu) / np.sqrt(np.maximum(var, 1e-6)), k)


def auc(negative_scores: Sequence[float] | Floats, positive_scores: Sequence[float] | Floats) -> float:
    """Area under the ROC curve of scores labelled 0 (``negative_scores``) against 1: the probability
    that a positive outscores a negative, ties counting one half (the Mann-Whitney statistic,
    what ``sklearn.metrics.roc_auc_score`` returns).

    OpenUnlearning labels the forget probes 0 and the holdout probes 1, so 1 means the forget
    probes look much more like members.

    Raises:
        ValueError: either set is empty (AUC is undefined), naming which.
    """
    neg = _nonempty(_floats(negative_scores, "negative_scores"), "the negative (label 0) score set")
    pos = _nonempty(_floats(positive_scores, "positive_scores"), "the positive (label 1) score set")
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
    ours = _nonempty(_floats(model_truth_ratios, "model_truth_ratios"), "the model's forget truth ratios")
    theirs = _nonempty(_floats(retain_truth_ratios, "retain_truth_ratios"), "the retain model's forget truth ratios")
    return float(stats.ks_2samp(ours, theirs).pvalue)


# --- aggregates -------------------------------------------------------------------------------------


def hm_aggregate(values: Sequence[float]) -> float:
    """OpenUnlearning's ``hm_aggregate`` (model_utility): ``scipy.stats.hmean`` of the components."""
    array = _nonempty(_floats(values, "values"), "model utility components")
    return float(stats.hmean(array))


def safe_hmean(values: Sequence[float]) -> float:
    """The paper's ``safe_hmean``: ``n / Σ 1/max(s, 1e-10)``.

    Raises:
        ValueError: no values, or a NaN among them.
    """
    array = _nonempty(_floats(values, "values"), "safe_hmean's values")
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


# --- one model's table ------------------------------------------------------------------------------

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
