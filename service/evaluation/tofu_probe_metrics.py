"""TOFU's per-probe quantities, as OpenUnlearning computes them, from numbers a model already produced.

Pure numpy over per-probe statistics (:mod:`service.engine.tofu_scoring` produces them): no model,
no torch. Names follow OpenUnlearning (``locuslab/open-unlearning``, ``src/evals/metrics``, read at
commit d3d7cf9): ``exact_memorization``, ``extraction_strength``, ``probability``,
``probability_w_options``, ``truth_ratio``, ``rouge`` (rougeL_recall) and the per-probe scores of the
membership-inference attacks ``mia_loss``, ``mia_zlib``, ``mia_min_k``, ``mia_min_k_plus_plus``.
What compares probe sets and models (AUC, forget quality, the paper's aggregates) is
:mod:`service.evaluation.tofu_aggregates`; one model's table is :mod:`service.evaluation.tofu_metrics`.

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

import re
import zlib
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "EPS",
    "TOFU_MIN_K",
    "Floats",
    "TruthRatioAggregator",
    "as_floats",
    "avg_loss",
    "exact_memorization",
    "extraction_strength",
    "min_k_plus_plus_score",
    "min_k_score",
    "nonempty",
    "probability",
    "probability_w_options",
    "rouge_l_recall",
    "truth_ratio",
    "truth_ratio_values",
    "zlib_score",
]

Floats = npt.NDArray[np.float64]

# OpenUnlearning's guard against division by zero, used in the truth ratio and probability_w_options.
EPS = 1e-10
# OpenUnlearning's TOFU configs run min-k and min-k++ with k = 0.4 (configs/eval/tofu_metrics).
TOFU_MIN_K = 0.4

TruthRatioAggregator = Literal["closer_to_1_better", "true_better", "prob_mean"]


def as_floats(values: Sequence[float] | Floats, name: str) -> Floats:
    """``values`` as a one-dimensional float64 array (``ValueError`` naming ``name`` otherwise)."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def nonempty(values: Floats, name: str) -> Floats:
    """``values``, refused with a ``ValueError`` naming ``name`` when empty."""
    if values.size == 0:
        raise ValueError(f"{name} is empty: the metric needs at least one probe")
    return values


# --- per-probe quantities -------------------------------------------------------------------------


def avg_loss(token_logprobs: Sequence[float] | Floats) -> float:
    """Mean negative log-likelihood (nats/token) of an answer from its tokens' log-probabilities.

    Raises:
        ValueError: no tokens (an answer must have at least one).
    """
    logprobs = nonempty(as_floats(token_logprobs, "token_logprobs"), "token_logprobs")
    return float(-logprobs.mean())


def probability(avg_losses: Sequence[float] | Floats) -> float:
    """OpenUnlearning's ``probability``: the mean over probes of ``exp(−avg_loss)``, the answer's
    probability normalised by its length (a geometric mean per token)."""
    losses = nonempty(as_floats(avg_losses, "avg_losses"), "avg_losses")
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
    correct = as_floats(correct_avg_loss, "correct_avg_loss")
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
    tr = nonempty(as_floats(values, "values"), "truth ratios")
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
    correct = nonempty(as_floats(correct_avg_loss, "correct_avg_loss"), "correct_avg_loss")
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
    logprobs = as_floats(token_logprobs, "token_logprobs")
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
    logprobs = as_floats(token_logprobs, "token_logprobs")
    mu, var = as_floats(vocab_mean, "vocab_mean"), as_floats(vocab_var, "vocab_var")
    if not logprobs.size == mu.size == var.size:
        raise ValueError(f"lengths differ: {logprobs.size} log-probs, {mu.size} means, {var.size} variances")
    if logprobs.size == 0:
        return 0.0
    return _bottom_k_mean((logprobs - mu) / np.sqrt(np.maximum(var, 1e-6)), k)
