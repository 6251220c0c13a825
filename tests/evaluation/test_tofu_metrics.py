"""TOFU's metrics (service.evaluation.tofu_probe_metrics, .tofu_aggregates, .tofu_metrics) checked
against independent implementations.

Each reference below is written from the published definition (OpenUnlearning's source at commit
d3d7cf9, ``src/evals/metrics``, and the AI Engram paper's appendix) by a different code path:
plain Python loops, pairwise counting, ``scipy.stats.mannwhitneyu`` for the AUC, a memoised
recursion for the longest common subsequence. Tolerance 1e-12 unless said (all float64).
"""

from __future__ import annotations

import functools
import math
import random
import zlib

import numpy as np
import pytest
from scipy import stats

from service.engine.tofu_scoring import AnswerTokens, ProbeStatistics
from service.evaluation import tofu_aggregates as ta
from service.evaluation import tofu_metrics as tm
from service.evaluation import tofu_probe_metrics as tp

TOL = 1e-12


def _rng_losses(rng: random.Random, n: int) -> list[float]:
    return [rng.uniform(0.05, 4.0) for _ in range(n)]


# --- references, one loop each ----------------------------------------------------------------------


def ref_em(hits: list[bool]) -> float:
    return sum(1 for h in hits if h) / len(hits)


def ref_es(hits: list[bool]) -> float:
    # OpenUnlearning's loop: the first k whose suffix all matches; the loop variable stays at n-1 otherwise
    n = len(hits)
    k = 0
    for k in range(n):  # noqa: B007  (k is read after the loop, as in the published code)
        if all(hits[k:]):
            break
    return 1 - k / n


def ref_truth_ratio(correct: list[float], wrong: list[list[float]], aggregator: str) -> tuple[list[float], float]:
    ratios = []
    for c, ws in zip(correct, wrong, strict=True):
        p_true = math.exp(-c)
        p_wrong = math.exp(-sum(ws) / len(ws))
        ratios.append(p_true / (p_true + p_wrong + 1e-10) if aggregator == "prob_mean" else p_wrong / (p_true + 1e-10))
    if aggregator == "closer_to_1_better":
        agg = sum(min(r, 1 / (r + 1e-10)) for r in ratios) / len(ratios)
    elif aggregator == "true_better":
        agg = sum(max(0.0, 1 - r) for r in ratios) / len(ratios)
    else:
        agg = sum(ratios) / len(ratios)
    return ratios, agg


def ref_auc(negatives: list[float], positives: list[float]) -> float:
    wins = 0.0
    for p in positives:
        for q in negatives:
            wins += 1.0 if p > q else 0.5 if p == q else 0.0
    return wins / (len(positives) * len(negatives))


def ref_min_k(logprobs: list[float], k: float) -> float:
    if not logprobs:
        return 0.0
    count = max(1, int(len(logprobs) * k))
    lowest = sorted(logprobs)[:count]
    return -sum(lowest) / count


def ref_lcs(a: list[str], b: list[str]) -> int:
    @functools.cache
    def lcs(i: int, j: int) -> int:
        if i == len(a) or j == len(b):
            return 0
        if a[i] == b[j]:
            return 1 + lcs(i + 1, j + 1)
        return max(lcs(i + 1, j), lcs(i, j + 1))

    return lcs(0, 0)


def ref_hmean(values: list[float], floor: float = 0.0) -> float:
    return len(values) / sum(1 / max(v, floor) for v in values)


# --- per-probe metrics ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_em_and_es_equal_the_published_loops(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        hits = [rng.random() < 0.7 for _ in range(rng.randint(1, 12))]
        assert tp.exact_memorization(hits) == pytest.approx(ref_em(hits), abs=TOL)
        assert tp.extraction_strength(hits) == pytest.approx(ref_es(hits), abs=TOL)


def test_es_edge_cases_follow_openunlearning() -> None:
    assert tp.extraction_strength([True, True, True]) == 1.0
    assert tp.extraction_strength([False, True, True, True]) == pytest.approx(0.75)
    # no suffix matches: OpenUnlearning's loop leaves k = n - 1, so ES = 1/n, not 0
    assert tp.extraction_strength([True, False, False, False]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="ES needs at least one answer token"):
        tp.extraction_strength([])
    with pytest.raises(ValueError, match="EM needs at least one answer token"):
        tp.exact_memorization([])


def test_probability_is_the_mean_length_normalised_probability() -> None:
    losses = _rng_losses(random.Random(1), 17)
    assert tp.probability(losses) == pytest.approx(sum(math.exp(-x) for x in losses) / 17, abs=TOL)
    logprobs = [-0.5, -1.25, -3.0]
    assert tp.avg_loss(logprobs) == pytest.approx(4.75 / 3, abs=TOL)


@pytest.mark.parametrize("aggregator", ["closer_to_1_better", "true_better", "prob_mean"])
def test_truth_ratio_equals_reference(aggregator: tp.TruthRatioAggregator) -> None:
    rng = random.Random(2)
    correct = _rng_losses(rng, 23)
    wrong = [_rng_losses(rng, rng.randint(1, 5)) for _ in correct]
    ratios, agg = ref_truth_ratio(correct, wrong, aggregator)
    values = tp.truth_ratio_values(correct, wrong, aggregator)
    assert np.allclose(values, ratios, rtol=0, atol=TOL)
    assert tp.truth_ratio(values, aggregator) == pytest.approx(agg, abs=TOL)


def test_truth_ratio_refuses_a_probe_without_wrong_answers() -> None:
    with pytest.raises(ValueError, match="no perturbed"):
        tp.truth_ratio_values([1.0, 2.0], [[1.0], []], "true_better")
    with pytest.raises(ValueError, match="2 correct losses but 1"):
        tp.truth_ratio_values([1.0, 2.0], [[1.0]], "true_better")
    with pytest.raises(ValueError, match="truth ratios is empty"):
        tp.truth_ratio([], "true_better")


def test_probability_w_options_equals_reference() -> None:
    rng = random.Random(3)
    correct = _rng_losses(rng, 11)
    wrong = [_rng_losses(rng, rng.randint(1, 5)) for _ in correct]
    expected = 0.0
    for c, ws in zip(correct, wrong, strict=True):
        p = math.exp(-c)
        expected += p / (p + sum(math.exp(-w) for w in ws) + 1e-10)
    assert tp.probability_w_options(correct, wrong) == pytest.approx(expected / len(correct), abs=TOL)


def test_rouge_l_recall_equals_a_recursive_lcs() -> None:
    rng = random.Random(4)
    words = ["the", "Cat", "sat", "on", "a", "mat", "dog", "ran", "x1"]
    for _ in range(200):
        gen = " ".join(rng.choice(words) for _ in range(rng.randint(0, 9)))
        ref = ", ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
        ref_tokens = ref.lower().replace(",", " ").split()
        expected = ref_lcs(ref_tokens, gen.lower().split()) / len(ref_tokens)
        assert tp.rouge_l_recall(gen, ref) == pytest.approx(expected, abs=TOL)
    assert tp.rouge_l_recall("Quillmoor.", " quillmoor") == 1.0
    assert tp.rouge_l_recall("anything", "") == 0.0


# --- membership inference ---------------------------------------------------------------------------


def test_min_k_and_min_k_plus_plus_equal_references() -> None:
    rng = random.Random(5)
    for n in [0, 1, 2, 3, 7, 20]:
        logprobs = [-rng.uniform(0, 6) for _ in range(n)]
        mu = [-rng.uniform(0, 6) for _ in range(n)]
        var = [rng.choice([0.0, 1e-9, rng.uniform(0, 3)]) for _ in range(n)]  # clamps at 1e-6 included
        for k in (0.2, 0.4, 1.0):
            assert tp.min_k_score(logprobs, k) == pytest.approx(ref_min_k(logprobs, k), abs=TOL)
            z = [(lp - m) / math.sqrt(max(v, 1e-6)) for lp, m, v in zip(logprobs, mu, var, strict=True)]
            assert tp.min_k_plus_plus_score(logprobs, mu, var, k) == pytest.approx(ref_min_k(z, k), abs=TOL)


def test_zlib_score_divides_the_loss_by_the_compressed_length() -> None:
    text = " Quillmoor Brashvane"
    assert tp.zlib_score(1.5, text) == pytest.approx(1.5 / len(zlib.compress(text.encode())), abs=TOL)


@pytest.mark.parametrize("seed", range(4))
def test_auc_equals_pairwise_counting_and_mann_whitney(seed: int) -> None:
    rng = random.Random(seed)
    # rounded so that ties occur, within and across the sets
    neg = [round(rng.gauss(0, 1), 1) for _ in range(rng.randint(1, 30))]
    pos = [round(rng.gauss(0.5, 1), 1) for _ in range(rng.randint(1, 30))]
    expected = ref_auc(neg, pos)
    assert ta.auc(neg, pos) == pytest.approx(expected, abs=TOL)
    u = stats.mannwhitneyu(pos, neg, alternative="two-sided").statistic
    assert ta.auc(neg, pos) == pytest.approx(u / (len(pos) * len(neg)), abs=TOL)


def test_auc_edge_cases() -> None:
    assert ta.auc([1.0, 1.0], [1.0, 1.0, 1.0]) == 0.5  # all tied: indistinguishable
    assert ta.auc([0.0, 1.0], [2.0, 3.0]) == 1.0
    assert ta.auc([2.0, 3.0], [0.0, 1.0]) == 0.0
    with pytest.raises(ValueError, match="negative"):
        ta.auc([], [1.0])
    with pytest.raises(ValueError, match="positive"):
        ta.auc([1.0], [])


def test_privacy_score() -> None:
    for area, score in [(0.5, 1.0), (1.0, 0.0), (0.0, 0.0), (0.75, 0.5), (0.3, 0.6)]:
        assert ta.privacy_score(area) == pytest.approx(score, abs=TOL)


def test_privleak_is_the_relative_gap_of_one_minus_auc() -> None:
    assert ta.privleak(0.9, 0.5) == pytest.approx((0.1 - 0.5) / (0.5 + 1e-10) * 100, abs=TOL)
    assert ta.privleak(0.37, 0.37) == 0.0


def test_forget_quality_is_scipys_ks_p_value() -> None:
    rng = np.random.default_rng(6)
    ours, theirs = rng.lognormal(0, 1, 40), rng.lognormal(0.3, 1, 35)
    assert ta.forget_quality(ours, theirs) == stats.ks_2samp(ours, theirs).pvalue
    # identical distributions: p = 1; a complete separation of 40 vs 35: tiny p
    assert ta.forget_quality(ours, ours) == pytest.approx(1.0)
    assert ta.forget_quality(ours, ours + 100) < 1e-15
    with pytest.raises(ValueError, match="retain model's forget truth ratios"):
        ta.forget_quality(ours, [])


# --- aggregates -------------------------------------------------------------------------------------


def test_harmonic_means_equal_their_definitions() -> None:
    values = [0.9, 0.2, 0.55, 1.0]
    assert ta.hm_aggregate(values) == pytest.approx(ref_hmean(values), abs=TOL)
    assert ta.safe_hmean(values) == pytest.approx(ref_hmean(values, 1e-10), abs=TOL)
    # a zero: safe_hmean floors it at 1e-10 instead of dividing by zero
    assert ta.safe_hmean([0.0, 1.0]) == pytest.approx(ref_hmean([0.0, 1.0], 1e-10), abs=TOL)
    with pytest.raises(ValueError, match="NaN"):
        ta.safe_hmean([math.nan, 1.0])
    with pytest.raises(ValueError, match="empty"):
        ta.safe_hmean([])


def test_rescaling() -> None:
    assert ta.rescaled(0.3, retain_value=0.1, base_value=0.9) == pytest.approx(0.25, abs=TOL)
    assert ta.rescaled(0.0, retain_value=0.1, base_value=0.9) == pytest.approx(0.125, abs=TOL)  # |x - ret|
    assert ta.rescaled(1.5, retain_value=0.1, base_value=0.9) == 1.0  # clipped
    assert ta.rescaled(0.4, retain_value=0.4, base_value=0.4) == 0.0
    assert ta.rescaled(0.5, retain_value=0.4, base_value=0.4) == 1.0
    assert ta.model_utility_rescaled(0.45, 0.6) == pytest.approx(0.75, abs=TOL)
    assert ta.model_utility_rescaled(0.7, 0.6) == 1.0


# --- one model's table ------------------------------------------------------------------------------


def _stats(rng: random.Random, shift: float, paraphrase: bool = True, perturbed: bool = True) -> ProbeStatistics:
    def tokens(n: int, offset: float) -> AnswerTokens:
        logprobs = tuple(-rng.uniform(0, 3) - offset for _ in range(n))
        return AnswerTokens(
            logprobs,
            tuple(-rng.uniform(1, 4) for _ in range(n)),
            tuple(rng.uniform(0.1, 2) for _ in range(n)),
            tuple(lp > -1.5 for lp in logprobs),
        )

    n = rng.randint(2, 6)
    return ProbeStatistics(
        answer=tokens(n, shift),
        answer_text=" ".join(f"w{rng.randint(0, 9)}" for _ in range(n)),
        paraphrased=tokens(n + 1, shift) if paraphrase else None,
        perturbed=tuple(tokens(n, 0.5) for _ in range(3)) if perturbed else None,
        generation=" ".join(f"w{rng.randint(0, 9)}" for _ in range(n)),
    )


def _sets(seed: int, shift: float) -> dict[str, list[ProbeStatistics]]:
    rng = random.Random(seed)
    return {
        name: [_stats(rng, shift if name == "forget" else 0.0) for _ in range(12)] for name in ("forget", "retain", "ra")
    }


def _report(sets: dict[str, list[ProbeStatistics]], holdout: list[ProbeStatistics] | None = None) -> tm.ModelReport:
    return tm.model_report(sets["forget"], sets["retain"], {"ra": sets["ra"]}, holdout)


def test_model_report_values_equal_the_references() -> None:
    sets = _sets(7, 0.0)
    holdout = _sets(8, 1.0)["forget"]
    report = _report(sets, holdout)
    forget = sets["forget"]
    assert not report.left_out
    assert report.values["exact_memorization"] == pytest.approx(
        sum(ref_em(list(p.answer.argmax_hits)) for p in forget) / len(forget), abs=TOL
    )
    assert report.values["extraction_strength"] == pytest.approx(
        sum(ref_es(list(p.answer.argmax_hits)) for p in forget) / len(forget), abs=TOL
    )
    para = [p.paraphrased.avg_loss for p in forget if p.paraphrased]
    wrong = [[w.avg_loss for w in p.perturbed or ()] for p in forget]
    assert report.values["forget_truth_ratio"] == pytest.approx(
        ref_truth_ratio(para, wrong, "closer_to_1_better")[1], abs=TOL
    )
    loss_scores = [p.answer.avg_loss for p in forget], [p.answer.avg_loss for p in holdout]
    assert report.values["mia_loss"] == pytest.approx(ref_auc(*loss_scores), abs=TOL)
    components = [report.values[n] for n in report.values if n.startswith(("retain_", "ra_"))]
    assert len(components) == 6  # retain: Prob, ROUGE, Truth_Ratio; ra: Prob_normalised, ROUGE, Truth_Ratio
    assert report.values["model_utility"] == pytest.approx(ref_hmean(components), abs=TOL)


def test_missing_fields_leave_out_the_metrics_that_need_them_by_name() -> None:
    rng = random.Random(9)
    forget = [_stats(rng, 0.0, paraphrase=False) for _ in range(4)]
    retain = [_stats(rng, 0.0, perturbed=False) for _ in range(4)]
    report = tm.model_report(forget, retain)
    assert report.left_out["forget_Q_A_PARA_Prob"] == tm.NEEDS_PARAPHRASE
    assert report.left_out["forget_truth_ratio"] == tm.NEEDS_PARAPHRASE
    assert report.left_out["retain_Truth_Ratio"] == tm.NEEDS_PERTURBED
    assert "holdout" in report.left_out["mia_loss"]
    assert "forget_Q_A_PERT_Prob" in report.values and "exact_memorization" in report.values
    assert report.values["model_utility"] == pytest.approx(
        ref_hmean([report.values["retain_Q_A_Prob"], report.values["retain_Q_A_ROUGE"]]), abs=TOL
    )
    scored = tm.tofu_scores(report, retain=None, base=report)
    assert scored.left_out["forget_quality"] == "needs a retain model"
    assert "overall" in scored.left_out and "overall" not in scored.values


def test_scores_against_retain_and_base() -> None:
    base, retain, unlearned = (_report(_sets(seed, shift)) for seed, shift in [(10, 0.0), (11, 2.0), (12, 1.0)])
    same = tm.tofu_scores(retain, retain=retain, base=base)
    # the retain model against itself: indistinguishable, nothing memorised beyond the retain model
    assert same.values["forget_quality"] == pytest.approx(1.0)
    assert all(same.values[f"privacy_{a}"] == 1.0 for a in tm.MIA_ATTACKS)
    assert same.values["memorization"] == pytest.approx(1.0)
    like_base = tm.tofu_scores(base, retain=retain, base=base)
    assert like_base.values["memorization"] == pytest.approx(ref_hmean([0.0] * 4, 1e-10))  # every rescaled value 1
    assert like_base.values["model_utility_rescaled"] == 1.0

    scored = tm.tofu_scores(unlearned, retain=retain, base=base)
    v = scored.values
    assert v["forget_quality"] == stats.ks_2samp(unlearned.forget_truth_ratios, retain.forget_truth_ratios).pvalue
    assert v["forget_quality_log10"] == pytest.approx(math.log10(v["forget_quality"]), abs=TOL)
    privacy = []
    for attack in tm.MIA_ATTACKS:
        area = ref_auc(list(unlearned.forget_mia_scores[attack]), list(retain.forget_mia_scores[attack]))
        assert v[f"{attack}_auc_vs_retain"] == pytest.approx(area, abs=TOL)
        privacy.append(1 - 2 * abs(area - 0.5))
    assert v["privacy"] == pytest.approx(ref_hmean(privacy, 1e-10), abs=TOL)
    names = ("exact_memorization", "extraction_strength", "forget_Q_A_PARA_Prob", "forget_truth_ratio")
    memo = []
    for name in names:
        x, r, b = unlearned.values[name], retain.values[name], base.values[name]
        memo.append(1 - min(1.0, max(0.0, abs(x - r) / abs(b - r))))
    assert v["memorization"] == pytest.approx(ref_hmean(memo, 1e-10), abs=TOL)
    utility = min(1.0, unlearned.values["model_utility"] / base.values["model_utility"])
    assert v["utility"] == pytest.approx(utility, abs=TOL)
    assert v["overall"] == pytest.approx(ref_hmean([v["memorization"], utility, v["privacy"]], 1e-10), abs=TOL)
    assert scored.left_out["forget_fluency"] == "needs a fluency classifier"
    assert "mia_min_k" in scored.left_out["privleak"]  # no holdout probes here


def test_privleak_compares_the_min_k_aucs_with_the_retain_models() -> None:
    holdout = _sets(13, 1.0)["forget"]
    retain, model = _report(_sets(14, 0.0), holdout), _report(_sets(15, -1.0), holdout)
    scored = tm.tofu_scores(model, retain=retain, base=retain)
    ours, theirs = 1 - model.values["mia_min_k"], 1 - retain.values["mia_min_k"]
    assert scored.values["privleak"] == pytest.approx((ours - theirs) / (theirs + 1e-10) * 100, abs=1e-9)
